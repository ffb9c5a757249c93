"""jaxlens.train's subspace masks, pyreft's variants and positions, and several placements
in one step (issue 48 item 8). NoReFT, ConsReFT, LoBiReFT and the orthogonal DiReFT
against pyreft 0.1.0's forward code, forward and gradients (pyreft pins transformers 4.45
and does not install here; its classes, loaded from its wheel beside pyvene 0.1.8, agreed
to 4e-16 when this was written), and reft_positions against its position rule. The
comparisons with pyvene itself are in tests/test_train_pyvene.py. Also the typed refusals
of item 10 that reach the verbs."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

torch = pytest.importorskip("torch")

import jaxlens as jl  # noqa: E402
from jaxlens import train as jt  # noqa: E402

H, B = 6, 5
TOL = 1e-12
PARTITION = [[0, 2], [2, 5]]  # two variables in one rotation: coordinates 0-1 and 2-4
SUBSPACES = [[0], [1], [0, 1], [1], [0]]


def _perturb(layer):
  """Moves a torch orthogonal parametrisation off its initial point (below the diagonal:
  torch reads the diagonal through .int())."""
  with torch.no_grad():
    w = layer.parametrizations.weight.original
    w.add_(0.3 * torch.randn(w.shape, dtype=w.dtype).tril(-1))


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


class _LowRankRotateLayer(torch.nn.Module):
  """pyreft's LowRankRotateLayer (interventions.py): an (n, m) weight, orthogonal init."""

  def __init__(self, n, m):
    super().__init__()
    self.weight = torch.nn.Parameter(torch.empty(n, m), requires_grad=True)
    torch.nn.init.orthogonal_(self.weight)

  def forward(self, x):
    return torch.matmul(x.to(self.weight.dtype), self.weight)


def _pyreft_rotation(k, seed):
  """pyreft's rotation: its LowRankRotateLayer under torch's orthogonal parametrisation."""
  torch.manual_seed(seed)
  rot = torch.nn.utils.parametrizations.orthogonal(_LowRankRotateLayer(H, k).double())
  _perturb(rot)
  return rot


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

  # One compiled program for the value and the gradient.
  def value(p):
    y = method.edit(p)(xj)
    return jnp.sum(jnp.sin(y)), y

  (_, y), g = jax.jit(jax.value_and_grad(value, has_aux=True))(params)
  np.testing.assert_allclose(y, out.detach().numpy(), atol=TOL, rtol=0)
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
  # A traced temperature (a schedule's) is the caller's: accepted (traced abstractly only).
  assert jax.eval_shape(lambda t: jl.boundless_das(p, x, t)(x), 0.5).shape == (2, 4)
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


def test_reft_positions_follow_pyreft():
  """pyreft's get_intervention_locations: at most half the prompt per set, padded to its
  widths (here with -1, no position). Checked against pyreft 0.1.0's function for
  prompts of 2-11 tokens and f1, l1, f3, l2, f1+l1, f2+l3, f5+l5, shared or not, when
  this was written; these are its values for a few."""
  got = jt.reft_positions([6, 3, 2], "f2+l3")
  assert got["first"].tolist() == [[0, 1, -1], [0, -1, -1], [0, -1, -1]]
  assert got["last"].tolist() == [[3, 4, 5], [2, -1, -1], [1, -1, -1]]
  shared = jt.reft_positions([6, 3], "f2+l3", share_weights=True)
  assert shared["all"].tolist() == [[0, 1, 3, 4, 5], [0, 2, -1, -1, -1]]
  assert list(jt.reft_positions([5], "l3")) == ["all"]
  for bad in ("x3", "f", "f2+", 3):
    with pytest.raises(jl.InvalidArgumentError, match="pyreft's 'f<n>'"):
      jt.reft_positions([4], bad)


class _TinyLM(nn.Module):
  """Tokens -> embedding -> ``hidden`` (a site) -> logits: a language model's shapes at the
  cost of two matrix products."""

  @nn.compact
  def __call__(self, tokens):
    h = jnp.tanh(nn.Embed(24, 8, name="embed")(tokens))
    return nn.Dense(24, name="out")(nn.Dense(8, name="hidden")(h))


def test_positions_tied_weights_and_reft_training_with_placements():
  """pyreft's set-up: LoReFT at the first and last prompt tokens with separate weights.
  multi_output equals the same edits written by hand with per-row masks (jl.units); a
  placement pair naming one parameter set gets the sum of the two placements' gradients;
  train_multi learns the answer."""
  model = _TinyLM()
  variables = model.init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
  site = "hidden"
  rng = np.random.default_rng(0)
  # One answer token: the loss is read at the last prompt token, which the edit reaches (a
  # token's output depends on its own position only, in this model).
  pairs = [(rng.integers(1, 24, int(n)).tolist(), [7]) for n in rng.integers(3, 6, 8)]
  batch = jt.reft_batch(pairs, "f1+l2")
  tokens = jnp.asarray(batch["tokens"])
  method = jt.LoReFT(rank=2)
  params = {
    name: jax.tree.map(lambda a: a + 0.1, method.init(jax.random.key(i), 8, jnp.float64))
    for i, name in enumerate(("first", "last"))
  }
  ats = [
    jt.At(site, method, "first", positions="first"),
    jt.At(site, method, "last", positions="last"),
  ]
  tied = [jt.At(site, method, "w", positions="first"), jt.At(site, method, "w", positions="last")]
  seq = np.arange(tokens.shape[1])
  spec = None
  for name in ("first", "last"):
    rows = (seq[None, :, None] == batch["positions"][name][:, None, :]).any(-1)[..., None]
    rule = jl.when(jl.units(site, jnp.asarray(rows)), jl.loreft(params[name]))
    spec = rule if spec is None else spec + rule

  def loss(p, ats):
    out = jt.multi_output(model, variables, ats, p, {**batch, "base": tokens})
    return jnp.sum(jnp.sin(out))

  @jax.jit  # one compiled program for all four
  def compute(params):
    got = jt.multi_output(model, variables, ats, params, {**batch, "base": tokens})
    want = spec.bind(model)(variables, tokens)
    g_tied = jax.grad(loss)({"w": params["first"]}, tied)["w"]
    g_apart = jax.grad(loss)({"first": params["first"], "last": params["first"]}, ats)
    return got, want, g_tied, g_apart

  got, want, g_tied, g_apart = compute(params)
  np.testing.assert_allclose(got, want, atol=1e-12, rtol=0)
  summed = jax.tree.map(jnp.add, g_apart["first"], g_apart["last"])
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_tied), jax.tree.leaves(summed)):
    np.testing.assert_allclose(a, b, atol=1e-12, err_msg=jax.tree_util.keystr(path))
  assert np.abs(np.asarray(g_apart["last"]["W"])).max() > 0  # both placements reach the loss

  params32 = {n: method.init(jax.random.key(i), 8) for i, n in enumerate(("first", "last"))}
  kw = {"steps": 12, "optimizer": optax.adam(0.3), "progress": False}
  result = jt.train_multi(model, variables, ats, params32, [batch], **kw)
  assert result.losses[-1] < 0.25 * result.losses[0]
  with pytest.raises(jl.InvalidArgumentError, match=r"parameters \['w'\]"):
    jt.multi_output(model, variables, tied, params, {**batch, "base": tokens})
  with pytest.raises(jl.InvalidArgumentError, match="positions 'middle'"):
    middle = [jt.At(site, method, "first", positions="middle")]
    jt.multi_output(model, variables, middle, params, {**batch, "base": tokens})


def test_causal_model_refuses_malformed_graphs_and_intervenes():
  values = {"a": [0, 1], "b": [0, 1], "c": [0, 1]}
  with pytest.raises(jl.InvalidArgumentError, match="cycle: b -> c -> b"):
    jt.CausalModel(values, {"a": [], "b": ["c"], "c": ["b"]}, {"b": abs, "c": abs})
  with pytest.raises(jl.InvalidArgumentError, match="'c' has parents but no function"):
    jt.CausalModel(values, {"a": [], "b": [], "c": ["a", "b"]}, {})
  with pytest.raises(jl.InvalidArgumentError, match=r"parents \['d'\] that are not variables"):
    jt.CausalModel(values, {"a": [], "b": [], "c": ["d"]}, {"c": abs})
  m = jt.CausalModel(values, {"a": [], "b": [], "c": ["a", "b"]}, {"c": lambda a, b: a ^ b})
  assert m.run({"a": 1, "b": 0}) == {"a": 1, "b": 0, "c": 1}
  assert m.run({"a": 1, "b": 0}, {"c": 0})["c"] == 0
  assert m.interchange({"a": 1, "b": 0}, {"a": {"a": 0, "b": 1}})["c"] == 0
  with pytest.raises(jl.InvalidArgumentError, match=r"run needs the inputs \['b'\]"):
    m.run({"a": 1})
  with pytest.raises(jl.InvalidArgumentError, match="unknown variables"):
    m.counterfactual(2, "d")
  factual = m.factual(6, seed=0)
  assert [s["c"] for s in factual["settings"]] == factual["label"].tolist()


def test_train_iit_and_iia_read_a_batchs_subspaces():
  """A batch's "subspaces" reach the method in train_iit, iia and intervened_output: a mask
  of the first 2 rotated coordinates is DAS(2); a method without subspaces refuses them."""
  f64 = {"param_dtype": jnp.float64}
  model = nn.Sequential([nn.Dense(H, **f64), jnp.tanh, nn.Dense(2, **f64)])
  variables = model.init(jax.random.key(0), jnp.zeros((1, 1, H), jnp.float64))
  rng = np.random.default_rng(0)
  base, source = rng.normal(size=(2, B, 1, H))
  label = (source[:, 0, 0] > 0).astype(np.int32)
  mask = np.tile((np.arange(H) < 2).astype(np.float64), (B, 1))
  params = jt.DAS(2).init(jax.random.key(1), H, jnp.float64)

  def run(method, **kw):
    return jt.intervened_output(model, variables, "layers_0", method, params, base, source, **kw)

  masked, das2 = jax.jit(lambda: (run(jt.DAS(5), subspaces=mask), run(jt.DAS(2))))()
  np.testing.assert_allclose(masked, das2, atol=TOL)
  batch = {"base": base, "source": source, "label": label, "subspaces": mask}
  kw = {"optimizer": optax.sgd(0.0), "progress": False, "steps": 1}
  result = jt.train_iit(model, variables, "layers_0", jt.DAS(5), params, [batch], **kw)
  logp = jax.nn.log_softmax(das2[:, -1])
  want = -np.mean(np.take_along_axis(np.asarray(logp), label[:, None], 1))
  assert abs(result.losses[0] - want) < 1e-12
  hits = np.mean(np.argmax(np.asarray(das2)[:, -1], -1) == label)
  assert jt.iia(model, variables, "layers_0", jt.DAS(5), params, batch) == hits
  with pytest.raises(jl.InvalidArgumentError, match="BoundlessDAS takes no per-example"):
    jt.intervened_output(
      model, variables, "layers_0", jt.BoundlessDAS(), {}, base, source, subspaces=mask
    )


def test_sae_mask_trains_with_the_dictionary_frozen_and_pca_refuses_training():
  """SAEInterchange(learn_mask=True) in train_iit: the mask over the dictionary's features
  moves, the dictionary (carried in the parameters, an argument of the step) does not.
  PCAInterchange has nothing to train: train_iit says so before the first step."""
  from jaxlens import sae as js

  f64 = {"param_dtype": jnp.float64}
  model = nn.Sequential([nn.Dense(H, **f64), jnp.tanh, nn.Dense(2, **f64)])
  variables = model.init(jax.random.key(0), jnp.zeros((1, 1, H), jnp.float64))
  rng = np.random.default_rng(1)
  base, source = rng.normal(size=(2, B, 1, H))
  batch = {"base": base, "source": source, "label": (source[:, 0, 0] > 0).astype(np.int32)}
  dictionary = js.SAE.init(jax.random.key(2), d_in=H, d_sae=10, dtype=jnp.float64)
  method = jt.SAEInterchange(dictionary, learn_mask=True)
  params = method.init(jax.random.key(0), H, jnp.float64)
  kw = {"optimizer": optax.adam(0.1), "progress": False, "steps": 2}
  result = jt.train_iit(model, variables, "layers_0", method, params, [batch], **kw)
  assert np.abs(np.asarray(result.params["mask"])).max() > 0.05
  for a, b in zip(jax.tree.leaves(params["sae"]), jax.tree.leaves(result.params["sae"])):
    np.testing.assert_array_equal(a, b)
  # Under a name in train_multi too.
  ats = [jt.At("layers_0", method, "m")]
  multi = jt.train_multi(model, variables, ats, {"m": params}, [batch], **kw)
  np.testing.assert_allclose(multi.losses, result.losses, atol=1e-12)
  basis = jt.pca_basis(rng.normal(size=(20, H)), 3, jnp.float64)
  with pytest.raises(jl.GradientContractError, match="would\\s+never train"):
    jt.train_iit(model, variables, "layers_0", jt.PCAInterchange(2), basis, [batch], **kw)
