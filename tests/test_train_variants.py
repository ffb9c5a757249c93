"""jaxlens.train's subspace masks and more methods against pyvene 0.1.8 and pyreft's math
(issue 48 item 8): per-example subspaces and partitions, sigmoid masks, PCA and SAE
interchanges against pyvene's interventions on the same weights and inputs (float64, or
float32 where pyvene fixes it); NoReFT, ConsReFT, LoBiReFT and the orthogonal DiReFT
against pyreft 0.1.0's forward code (pyreft pins transformers 4.45 and does not install
here), forward and gradients. Also the typed refusals of item 10 that reach the verbs."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from lazy_import import LazyModule, missing  # noqa: E402

import jaxlens as jl  # noqa: E402
from jaxlens import sae as js  # noqa: E402
from jaxlens import train as jt  # noqa: E402

needs_pyvene = pytest.mark.skipif(bool(missing("pyvene")), reason="needs pyvene")
pv = LazyModule("pyvene")

H, B = 6, 5
TOL = 1e-12
PARTITION = [[0, 2], [2, 5]]  # two variables in one rotation: coordinates 0-1 and 2-4
# Ragged per-example lists: pyvene's per-example (non-"fast") path.
SUBSPACES = [[0], [1], [0, 1], [1], [0]]


def _inputs(seed=0):
  rng = np.random.default_rng(seed)
  return rng.normal(size=(B, 1, H)), rng.normal(size=(B, 1, H))


def _perturb(layer):
  """Moves a torch orthogonal parametrisation off its initial point (below the diagonal:
  torch reads the diagonal through .int())."""
  with torch.no_grad():
    w = layer.parametrizations.weight.original
    w.add_(0.3 * torch.randn(w.shape, dtype=w.dtype).tril(-1))


def _run(edit, base, source_is_array=True):
  del source_is_array
  return np.asarray(edit(jnp.asarray(base)))


def test_subspace_mask_reads_pyvene_partitions_and_refuses_bad_indices():
  got = jt.subspace_mask(SUBSPACES, H, PARTITION)
  assert got.shape == (B, H)
  assert got[2].tolist() == [1, 1, 1, 1, 1, 0]
  assert jt.subspace_mask([[3, 1]], 4).tolist() == [[0, 1, 0, 1]]
  with pytest.raises(jl.InvalidArgumentError, match=r"\[index_out_of_range\].*variable 2"):
    jt.subspace_mask([[2]], H, PARTITION)
  with pytest.raises(jl.InvalidArgumentError, match=r"\[index_out_of_range\].*\[7\]"):
    jt.subspace_mask([[7]], H)
  with pytest.raises(jl.InvalidArgumentError, match=r"k must be a positive int"):
    jt.subspace_mask([[0]], 0)


@needs_pyvene
@pytest.mark.parametrize("low_rank", [False, True])
def test_per_example_subspaces_in_partitions_equal_pyvene(low_rank):
  torch.manual_seed(0)
  if low_rank:
    # Its per-example path stacks the examples' columns: equal sizes, different columns.
    partition, subspaces = [[0, 2], [2, 4]], [[0], [1], [0], [1], [1]]
    iv = pv.LowRankRotatedSpaceIntervention(
      embed_dim=H, low_rank_dimension=5, subspace_partition=partition
    ).double()
    method, k = jt.LowRankDAS(5), 5
  else:
    partition, subspaces = PARTITION, SUBSPACES
    iv = pv.RotatedSpaceIntervention(embed_dim=H, subspace_partition=partition).double()
    method, k = jt.DAS(1), H
  _perturb(iv.rotate_layer)
  import torch_bridge

  params = torch_bridge.from_pyvene(iv)
  base, source = _inputs()
  if low_rank:  # pyvene's low-rank per-example path indexes (batch, k) values
    base, source = base[:, 0], source[:, 0]
  want = iv(torch.from_numpy(base), torch.from_numpy(source), subspaces=subspaces)
  mask = jt.subspace_mask(subspaces, k, partition, np.float64)
  got = _run(method.edit(params, source, subspaces=mask), base)
  np.testing.assert_allclose(got, want.detach().numpy(), atol=TOL, rtol=0)
  # Examples interchange different coordinates: no single dim gives this.
  shared = _run(method.edit(params, source, subspaces=mask[1]), base)  # one (k,) mask for all
  assert np.allclose(got[1], shared[1]) and not np.allclose(got[0], shared[0])


@needs_pyvene
def test_sigmoid_masks_equal_pyvene():
  torch.manual_seed(1)
  base, source = _inputs(1)
  b, s = torch.from_numpy(base), torch.from_numpy(source)
  # Per feature.
  iv = pv.SigmoidMaskIntervention(embed_dim=H).double()
  with torch.no_grad():
    iv.mask.copy_(torch.randn(H, dtype=torch.float64))
    # pyvene 0.1.8 copies its temperature parameter with torch.tensor(tensor) (a warning),
    # and a float becomes a float32 tensor: a temperature exact in float32.
    del iv.temperature
    iv.temperature = 0.5
  params = {"mask": jnp.asarray(iv.mask.detach().numpy())}
  got = _run(jt.SigmoidMask().edit(params, source, 0.5), base)
  np.testing.assert_allclose(got, iv(b, s).detach().numpy(), atol=TOL, rtol=0)
  # In a rotated space.
  iv = pv.SigmoidMaskRotatedSpaceIntervention(embed_dim=H).double()
  _perturb(iv.rotate_layer)
  with torch.no_grad():
    iv.masks.copy_(torch.randn(H, dtype=torch.float64) * 3)
    iv.set_temperature(torch.tensor(2.0, dtype=torch.float64))
  import torch_bridge

  params = {
    "rotation": torch_bridge.from_pyvene(iv)["rotation"],
    "masks": jnp.asarray(iv.masks.detach().numpy()),
  }
  # (pyvene's mask is (batch, d): (batch, d) values.)
  got = _run(jt.SigmoidMaskDAS().edit(params, source[:, 0], 2.0), base[:, 0])
  np.testing.assert_allclose(got, iv(b[:, 0], s[:, 0]).detach().numpy(), atol=TOL, rtol=0)
  init = jt.SigmoidMaskDAS().init(jax.random.key(0), H)
  assert float(init["masks"][0]) == 100.0 and init["masks"].shape == (H,)


@needs_pyvene
def test_pca_interchange_equals_pyvene_and_pca_basis_is_a_standardised_pca():
  rng = np.random.default_rng(2)
  acts = rng.normal(size=(40, H)) @ rng.normal(size=(H, H)) + 3.0
  basis = jt.pca_basis(acts, 4, jnp.float32)
  c = np.asarray(basis["components"])
  np.testing.assert_allclose(c @ c.T, np.eye(4), atol=1e-5)
  z = (acts - acts.mean(0)) / acts.std(0)
  top = np.linalg.svd(z, full_matrices=False)[2][:4]
  np.testing.assert_allclose(np.abs(c @ top.T), np.eye(4), atol=1e-4)  # the same axes
  pca = types.SimpleNamespace(components_=c)
  iv = pv.PCARotatedSpaceIntervention(
    embed_dim=H, pca=pca, pca_mean=np.asarray(basis["mean"]), pca_std=np.asarray(basis["std"])
  )
  iv.set_interchange_dim(2)
  base, source = (a.astype(np.float32) for a in _inputs(2))
  want = iv(torch.from_numpy(base), torch.from_numpy(source)).detach().numpy()
  got = _run(jt.PCAInterchange(2).edit(basis, source), base)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
  with pytest.raises(jl.InvalidArgumentError, match="dim=5 of a basis of 4"):
    jt.PCAInterchange(5).edit(basis, source)


@needs_pyvene
def test_sae_feature_interchange_equals_pyvene_jumprelu():
  n = 10
  iv = pv.JumpReLUAutoencoderIntervention(embed_dim=H, low_rank_dimension=n).double()
  rng = np.random.default_rng(3)
  with torch.no_grad():
    for name in ("W_enc", "W_dec", "b_enc", "b_dec"):
      getattr(iv, name).copy_(torch.from_numpy(rng.normal(size=getattr(iv, name).shape)))
    iv.threshold.copy_(torch.from_numpy(np.abs(rng.normal(size=n)) * 0.5))
  iv.set_interchange_dim(4)
  sae = js.SAE(
    *(jnp.asarray(getattr(iv, f).detach().numpy()) for f in ("W_enc", "b_enc", "W_dec", "b_dec")),
    threshold=jnp.asarray(iv.threshold.detach().numpy()),
    activation="jumprelu",
    apply_b_dec_to_input=False,
  )
  base, source = _inputs(3)
  want = iv(torch.from_numpy(base), torch.from_numpy(source)).detach().numpy()
  method = jt.SAEInterchange(sae, features=(0, 1, 2, 3))
  got = _run(method.edit(method.init(None, H), source), base)
  np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
  # keep_error adds the reconstruction error back: no feature interchanged is the identity.
  keep = jt.SAEInterchange(sae, keep_error=True)
  np.testing.assert_allclose(_run(keep.edit({}, source), base), base, atol=TOL)
  learned = jt.SAEInterchange(sae, learn_mask=True)
  assert learned.init(None, H)["mask"].shape == (n,)
  with pytest.raises(jl.InvalidArgumentError, match=r"features \[10\]"):
    jt.SAEInterchange(sae, features=(10,))


def _pyreft_rotation(k, seed):
  """pyreft's LowRankRotateLayer (pyvene's, the same class) under torch's orthogonal map."""
  torch.manual_seed(seed)
  layers = LazyModule("pyvene.models.layers")
  rot = torch.nn.utils.parametrizations.orthogonal(layers.LowRankRotateLayer(H, k).double())
  _perturb(rot)
  return rot


@needs_pyvene
@pytest.mark.parametrize("name", ["noreft", "noreft_bias", "consreft", "lobireft", "direft"])
def test_reft_variants_equal_pyreft_forward_and_gradients(name):
  """pyreft 0.1.0's forward code, line for line (interventions.py), with act_fn linear and
  no dropout (its defaults)."""
  import torch_bridge

  k = 3
  x = torch.from_numpy(np.random.default_rng(4).normal(size=(2, 4, H)))
  torch.manual_seed(5)
  if name.startswith("noreft"):
    bias = name == "noreft_bias"
    proj, learned = torch.nn.Linear(H, k, bias=bias).double(), torch.nn.Linear(H, k).double()
    out = x + torch.matmul(learned(x) - proj(x), proj.weight)
    tensors = {"P": proj.weight, "W": learned.weight, "b": learned.bias}
    if bias:
      tensors["c"] = proj.bias
    method = jt.NoReFT(k, bias=bias)
  else:
    rot = _pyreft_rotation(k, 6)
    holder = torch.nn.Module()
    holder.rotate_layer = rot
    rotation = torch_bridge.from_pyvene(holder)["rotation"]
    if name == "direft":
      learned = torch.nn.Linear(H, k).double()
      out = x + torch.matmul(learned(x), rot.weight.T)
      tensors = {"W1": learned.weight, "b": learned.bias}
      method = jt.DiReFT(k, orthogonal=True)
    else:
      b = torch.nn.Parameter(torch.rand(k, dtype=torch.float64))
      rotated = rot(x)
      out = x + torch.matmul((b - rotated) if name == "consreft" else b, rot.weight.T)
      tensors = {"b": b}
      method = jt.ConsReFT(k) if name == "consreft" else jt.LoBiReFT(k)
    tensors["rotation"] = rot.parametrizations.weight.original
  out.sin().sum().backward()
  params = {n: jnp.asarray(t.detach().numpy()) for n, t in tensors.items() if n != "rotation"}
  if "rotation" in tensors:
    params["rotation"] = rotation
  xj = jnp.asarray(x.numpy())
  f = jax.jit(lambda p: method.edit(p)(xj))
  np.testing.assert_allclose(f(params), out.detach().numpy(), atol=TOL, rtol=0)
  g = jax.grad(lambda p: jnp.sum(jnp.sin(f(p))))(params)
  for n, t in tensors.items():
    got = g[n]["raw"] if n == "rotation" else g[n]
    np.testing.assert_allclose(got, t.grad.numpy(), atol=1e-10, err_msg=n)
  # init gives the shapes the edit reads.
  init = method.init(jax.random.key(0), H, jnp.float64)
  assert jax.tree.map(jnp.shape, init) == jax.tree.map(jnp.shape, params)


def test_temperatures_and_variant_arguments_are_typed_errors():
  p = jt.BoundlessDAS().init(jax.random.key(0), 4)
  x = jnp.ones((2, 4))
  for t in (0.0, -1.0, float("nan")):
    with pytest.raises(jl.InvalidArgumentError, match=r"temperature must be a finite number > 0"):
      jl.boundless_das(p, x, t)
    with pytest.raises(jl.InvalidArgumentError, match=r"temperature"):
      jt.BoundlessDAS().edit(p, x, t)
    with pytest.raises(jl.InvalidArgumentError, match=r"temperature"):
      jt.SigmoidMask().edit({"mask": jnp.zeros(4)}, x, t)
  assert np.isfinite(np.asarray(jl.boundless_das(p, x, jnp.asarray(0.5))(x))).all()
  for make, field in [
    (lambda: jt.SigmoidMaskDAS(temperature_end=0.0), "temperature_end"),
    (lambda: jt.NoReFT(0), "rank"),
    (lambda: jt.ConsReFT(-1), "rank"),
    (lambda: jt.LoBiReFT(1.5), "rank"),
    (lambda: jt.DiReFT(2, orthogonal="yes"), "orthogonal"),
    (lambda: jt.PCAInterchange(0), "dim"),
  ]:
    with pytest.raises(jl.InvalidArgumentError, match=r"\[invalid_argument\]") as info:
      make()
    assert field in str(info.value) or "rank" in str(info.value)
