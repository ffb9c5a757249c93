"""jaxlens.train against pyvene 0.1.8: the same torch model (converted with torch_bridge), the
same initial parameters and batches give the same losses and parameter gradients (float64,
1e-8) and the same IIA after training; LoReFT's forward and gradients equal pyreft's formula."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import types

import numpy as np
import optax
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from lazy_import import LazyModule, missing  # noqa: E402

pytestmark = pytest.mark.skipif(bool(missing("pyvene")), reason="needs pyvene")
pv = LazyModule("pyvene")

import jaxlens as jl  # noqa: E402
import torch_bridge  # noqa: E402
from jaxlens import sae as js  # noqa: E402
from jaxlens import train as jt  # noqa: E402
from torch_bridge.convert import from_torch  # noqa: E402

D, H, B, K = 8, 12, 6, 3
TOL = 1e-8


class _Wrapped(torch.nn.Module):
  """The torch MLP with what pyvene reads from a model (``config``, ``device``)."""

  def __init__(self, seq):
    super().__init__()
    self.seq = seq
    self.config = transformers.PretrainedConfig(hidden_size=H)
    self.device = torch.device("cpu")

  def forward(self, x):
    return self.seq(x)


@pytest.fixture(scope="module")
def models():
  torch.manual_seed(0)
  seq = torch.nn.Sequential(
    torch.nn.Linear(D, H),
    torch.nn.Tanh(),
    torch.nn.Linear(H, H),
    torch.nn.Tanh(),
    torch.nn.Linear(H, 2),
  ).double()
  for p in seq.parameters():
    p.requires_grad_(False)
  flax_model, variables, site_map = from_torch(seq, dtype=torch.float64)
  return seq, flax_model, variables, site_map["2"]


def _batches(n, seed):
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    base = rng.normal(size=(B, 1, D))
    source = rng.normal(size=(B, 1, D))
    out.append({"base": base, "source": source, "label": (source[:, 0, 0] > 0).astype(np.int32)})
  return out


CASES = {
  "das": (lambda: pv.RotatedSpaceIntervention(embed_dim=H), lambda: jt.DAS(dim=3)),
  "boundless_das": (
    lambda: pv.BoundlessRotatedSpaceIntervention(embed_dim=H),
    lambda: jt.BoundlessDAS(temperature_start=5.0, temperature_end=0.5),
  ),
  "low_rank_das": (
    lambda: pv.LowRankRotatedSpaceIntervention(embed_dim=H, low_rank_dimension=3),
    lambda: jt.LowRankDAS(rank=3),
  ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_losses_gradients_and_iia_agree_with_pyvene(models, name):
  seq, flax_model, variables, site = models
  make_pv, make_jt = CASES[name]
  torch.manual_seed(1)
  intervention = make_pv().double()
  if name == "das":
    intervention.set_interchange_dim(3)
  method = make_jt()
  params = torch_bridge.from_pyvene(intervention)
  trained = [intervention.rotate_layer.parametrizations.weight.original]
  if name == "boundless_das":
    assert params["boundary"].shape == (1,)
    trained.append(intervention.intervention_boundaries)
    # pyvene's population is int64, and int64 - 0.0 is float32 in torch: its mask would be
    # computed in float32 whatever the model's dtype. A float64 population keeps it float64.
    intervention.intervention_population = torch.nn.Parameter(
      torch.arange(H, dtype=torch.float64), requires_grad=False
    )
  config = pv.IntervenableConfig(
    representations=[
      pv.RepresentationConfig(
        component="seq.2.output", unit="pos", max_number_of_units=1, intervention=intervention
      )
    ]
  )
  ivm = pv.IntervenableModel(config, _Wrapped(seq))
  ivm.disable_model_gradients()
  steps = 6
  batches = _batches(steps, seed=2)
  opt_t = torch.optim.Adam(trained, lr=0.02)

  def torch_out(batch, step):
    if name == "boundless_das":
      intervention.set_temperature(
        torch.tensor(float(method.temperature(step, steps)), dtype=torch.float64)
      )
    _, out = ivm(
      {"x": torch.from_numpy(batch["base"])},
      [{"x": torch.from_numpy(batch["source"])}],
      {"sources->base": 0},
    )
    return out[:, -1]

  def jax_loss(p, batch, step):
    t = method.temperature(jnp.asarray(step, float), steps) if name == "boundless_das" else None
    out = jt.intervened_output(
      flax_model, variables, site, method, p, batch["base"], batch["source"], temperature=t
    )
    logp = jax.nn.log_softmax(out[:, -1])
    return -jnp.mean(jnp.take_along_axis(logp, batch["label"][:, None], 1))

  grad_fn = jax.jit(jax.value_and_grad(jax_loss))
  opt_j = optax.adam(0.02)
  state = opt_j.init(params)
  p = params
  torch_losses = []
  for step, batch in enumerate(batches):
    out = torch_out(batch, step)
    loss_t = torch.nn.functional.cross_entropy(out, torch.from_numpy(batch["label"]).long())
    opt_t.zero_grad()
    loss_t.backward()
    torch_losses.append(loss_t.item())
    if step < K:  # the first steps: the same loss and the same gradients
      value, g = grad_fn(p, batch, step)
      assert abs(float(value) - loss_t.item()) <= TOL
      np.testing.assert_allclose(g["rotation"]["raw"], trained[0].grad.numpy(), atol=TOL, rtol=0)
      assert not np.asarray(g["rotation"]["base"]).any()
      if name == "boundless_das":
        np.testing.assert_allclose(g["boundary"], trained[1].grad.numpy(), atol=TOL, rtol=0)
      with jax.numpy_dtype_promotion("standard"):
        updates, state = opt_j.update(g, state, p)
      p = optax.apply_updates(p, updates)
    opt_t.step()
  # The training loop: the same losses over every step, and the same IIA after training.
  result = jt.train_iit(
    flax_model,
    variables,
    site,
    method,
    params,
    batches,
    optimizer=optax.adam(0.02),
    progress=False,
  )
  np.testing.assert_allclose(result.losses, torch_losses, atol=1e-7, rtol=0)
  eval_batch = _batches(1, seed=3)[0]
  with torch.no_grad():
    hits_t = torch_out(eval_batch, steps - 1).argmax(-1).numpy() == eval_batch["label"]
  temperature = method.temperature(steps - 1, steps) if name == "boundless_das" else None
  got = jt.iia(
    flax_model, variables, site, method, result.params, eval_batch, temperature=temperature
  )
  assert got == float(np.mean(hits_t))


def test_loreft_forward_and_gradients_equal_pyreft_formula():
  """pyreft's LoreftIntervention: ``base + (learned_source(base) - rotate_layer(base)) @
  rotate_layer.weight.T`` with an orthogonal-parametrised LowRankRotateLayer."""
  torch.manual_seed(0)
  rotate = torch.nn.utils.parametrizations.orthogonal(
    LazyModule("pyvene.models.layers").LowRankRotateLayer(D, 3).double()
  )
  source = torch.nn.Linear(D, 3).double()
  with torch.no_grad():
    # Off the diagonal: torch reads the diagonal through .int() (see jaxlens.orthogonal).
    noise = torch.randn(D, 3, dtype=torch.float64).tril(-1)
    rotate.parametrizations.weight.original.add_(0.3 * noise)
  x = torch.randn(4, 5, D, dtype=torch.float64)
  out = x + torch.matmul(source(x) - rotate(x), rotate.weight.T)
  (out.sin().sum()).backward()
  holder = torch.nn.Module()  # as pyreft's LoreftIntervention holds them
  holder.rotate_layer, holder.learned_source = rotate, source
  params = torch_bridge.from_pyvene(holder)
  xj = jnp.asarray(x.numpy())
  f = jax.jit(lambda p: jt.LoReFT(3).edit(p)(xj))
  np.testing.assert_allclose(f(params), out.detach().numpy(), atol=1e-12, rtol=0)
  g = jax.jit(jax.grad(lambda p: jnp.sum(jnp.sin(f(p)))))(params)
  np.testing.assert_allclose(
    g["rotation"]["raw"], rotate.parametrizations.weight.original.grad.numpy(), atol=1e-12
  )
  np.testing.assert_allclose(g["W"], source.weight.grad.numpy(), atol=1e-12)
  np.testing.assert_allclose(g["b"], source.bias.grad.numpy(), atol=1e-12)


def test_saved_trained_interventions_run_in_the_torch_reference(models, tmp_path):
  """A spec holding each trained intervention, saved by jaxlens, loads as torch reference
  hooks on the torch model (torch_bridge.load_spec) and computes the same output."""
  seq, flax_model, variables, site = models
  rng = np.random.default_rng(5)
  x = rng.normal(size=(3, 2, D))
  donor = jl.trace(flax_model, variables, jnp.asarray(rng.normal(size=(3, 2, D))))
  _, _, site_map = from_torch(seq, dtype=torch.float64)

  for method in (jt.DAS(3), jt.BoundlessDAS(), jt.LowRankDAS(3), jt.LoReFT(3), jt.DiReFT(3)):
    params = method.init(jax.random.key(0), H, jnp.float64)
    # Away from the init (bases stay orthogonal): the rotations are not their bases.
    params = jax.tree_util.tree_map_with_path(
      lambda path, a: a if "base" in jax.tree_util.keystr(path) else a + 0.1, params
    )
    spec = jl.when(site, method.edit(params, donor, 0.5))
    want = spec.bind(flax_model)(variables, jnp.asarray(x))
    path = tmp_path / type(method).__name__
    spec.save(path)
    got = torch_bridge.load_spec(path, site_map).bind(seq)(torch.from_numpy(x))
    np.testing.assert_allclose(got.detach().numpy(), want, atol=1e-12, err_msg=repr(method))


def test_from_pyvene_refuses_what_it_cannot_read():
  with pytest.raises(jl.InvalidArgumentError, match="has no rotate_layer"):
    torch_bridge.from_pyvene(torch.nn.Linear(2, 2))
  holder = torch.nn.Module()
  holder.rotate_layer = torch.nn.Linear(2, 2)
  with pytest.raises(
    jl.InvalidArgumentError, match="no torch.nn.utils.parametrizations.orthogonal"
  ):
    torch_bridge.from_pyvene(holder)


# --------------------------------------------------------------------------
# Per-example subspaces, sigmoid masks, PCA, SAE features (issue 48 item 8): pyvene's
# interventions called on the same weights and values.

HV, BV, TOLV = 6, 5, 1e-12
PARTITION = [[0, 2], [2, 5]]  # two variables in one rotation: coordinates 0-1 and 2-4
SUBSPACES = [[0], [1], [0, 1], [1], [0]]  # ragged: pyvene's per-example (not "fast") path


def _variant_inputs(seed=0):
  rng = np.random.default_rng(seed)
  return rng.normal(size=(BV, 1, HV)), rng.normal(size=(BV, 1, HV))


def _perturb(layer):
  """Moves a torch orthogonal parametrisation off its initial point (below the diagonal:
  torch reads the diagonal through .int())."""
  with torch.no_grad():
    w = layer.parametrizations.weight.original
    w.add_(0.3 * torch.randn(w.shape, dtype=w.dtype).tril(-1))


def _run_edit(edit, base):
  # One jitted program: eagerly, every primitive of the rotation's expm compiles apart.
  return np.asarray(jax.jit(lambda b: edit(b))(jnp.asarray(base)))


@pytest.mark.parametrize("low_rank", [False, True])
def test_per_example_subspaces_in_partitions_equal_pyvene(low_rank):
  torch.manual_seed(0)
  if low_rank:
    # Its per-example path stacks the examples' columns: equal sizes, different columns.
    partition, subspaces = [[0, 2], [2, 4]], [[0], [1], [0], [1], [1]]
    iv = pv.LowRankRotatedSpaceIntervention(
      embed_dim=HV, low_rank_dimension=5, subspace_partition=partition
    ).double()
    method, k = jt.LowRankDAS(5), 5
  else:
    partition, subspaces = PARTITION, SUBSPACES
    iv = pv.RotatedSpaceIntervention(embed_dim=HV, subspace_partition=partition).double()
    method, k = jt.DAS(1), HV
  _perturb(iv.rotate_layer)
  params = torch_bridge.from_pyvene(iv)
  base, source = _variant_inputs()
  if low_rank:  # pyvene's low-rank per-example path indexes (batch, k) values
    base, source = base[:, 0], source[:, 0]
  want = iv(torch.from_numpy(base), torch.from_numpy(source), subspaces=subspaces)
  mask = jt.subspace_mask(subspaces, k, partition, np.float64)
  got = _run_edit(method.edit(params, source, subspaces=mask), base)
  np.testing.assert_allclose(got, want.detach().numpy(), atol=TOLV, rtol=0)
  # Examples interchange different coordinates: no single dim gives this.
  shared = _run_edit(method.edit(params, source, subspaces=mask[1]), base)  # one (k,) mask for all
  assert np.allclose(got[1], shared[1]) and not np.allclose(got[0], shared[0])


def test_sigmoid_masks_equal_pyvene():
  torch.manual_seed(1)
  base, source = _variant_inputs(1)
  b, s = torch.from_numpy(base), torch.from_numpy(source)
  # Per feature.
  iv = pv.SigmoidMaskIntervention(embed_dim=HV).double()
  with torch.no_grad():
    iv.mask.copy_(torch.randn(HV, dtype=torch.float64))
    # pyvene 0.1.8 copies its temperature parameter with torch.tensor(tensor) (a warning),
    # and a float becomes a float32 tensor: a temperature exact in float32.
    del iv.temperature
    iv.temperature = 0.5
  params = {"mask": jnp.asarray(iv.mask.detach().numpy())}
  got = _run_edit(jt.SigmoidMask().edit(params, source, 0.5), base)
  np.testing.assert_allclose(got, iv(b, s).detach().numpy(), atol=TOLV, rtol=0)
  # In a rotated space.
  iv = pv.SigmoidMaskRotatedSpaceIntervention(embed_dim=HV).double()
  _perturb(iv.rotate_layer)
  with torch.no_grad():
    iv.masks.copy_(torch.randn(HV, dtype=torch.float64) * 3)
    iv.set_temperature(torch.tensor(2.0, dtype=torch.float64))
  params = {
    "rotation": torch_bridge.from_pyvene(iv)["rotation"],
    "masks": jnp.asarray(iv.masks.detach().numpy()),
  }
  # (pyvene's mask is (batch, d): (batch, d) values.)
  got = _run_edit(jt.SigmoidMaskDAS().edit(params, source[:, 0], 2.0), base[:, 0])
  np.testing.assert_allclose(got, iv(b[:, 0], s[:, 0]).detach().numpy(), atol=TOLV, rtol=0)
  init = jt.SigmoidMaskDAS().init(jax.random.key(0), HV)
  assert float(init["masks"][0]) == 100.0 and init["masks"].shape == (HV,)


def test_pca_interchange_equals_pyvene_and_pca_basis_is_a_standardised_pca():
  rng = np.random.default_rng(2)
  acts = rng.normal(size=(40, HV)) @ rng.normal(size=(HV, HV)) + 3.0
  basis = jt.pca_basis(acts, 4, jnp.float32)
  c = np.asarray(basis["components"])
  np.testing.assert_allclose(c @ c.T, np.eye(4), atol=1e-5)
  z = (acts - acts.mean(0)) / acts.std(0)
  top = np.linalg.svd(z, full_matrices=False)[2][:4]
  np.testing.assert_allclose(np.abs(c @ top.T), np.eye(4), atol=1e-4)  # the same axes
  pca = types.SimpleNamespace(components_=c)
  iv = pv.PCARotatedSpaceIntervention(
    embed_dim=HV, pca=pca, pca_mean=np.asarray(basis["mean"]), pca_std=np.asarray(basis["std"])
  )
  iv.set_interchange_dim(2)
  base, source = (a.astype(np.float32) for a in _variant_inputs(2))
  want = iv(torch.from_numpy(base), torch.from_numpy(source)).detach().numpy()
  got = _run_edit(jt.PCAInterchange(2).edit(basis, source), base)
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
  with pytest.raises(jl.InvalidArgumentError, match="dim=5 of a basis of 4"):
    jt.PCAInterchange(5).edit(basis, source)


def test_sae_feature_interchange_equals_pyvene_jumprelu():
  n = 10
  iv = pv.JumpReLUAutoencoderIntervention(embed_dim=HV, low_rank_dimension=n).double()
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
  base, source = _variant_inputs(3)
  want = iv(torch.from_numpy(base), torch.from_numpy(source)).detach().numpy()
  method = jt.SAEInterchange(sae, features=(0, 1, 2, 3))
  got = _run_edit(method.edit(method.init(None, HV), source), base)
  np.testing.assert_allclose(got, want, atol=TOLV, rtol=0)
  # keep_error adds the reconstruction error back: no feature interchanged is the identity.
  keep = jt.SAEInterchange(sae, keep_error=True)
  np.testing.assert_allclose(_run_edit(keep.edit({}, source), base), base, atol=TOLV)
  learned = jt.SAEInterchange(sae, learn_mask=True)
  assert learned.init(None, HV)["mask"].shape == (n,)
  with pytest.raises(jl.InvalidArgumentError, match=r"features \[10\]"):
    jt.SAEInterchange(sae, features=(10,))


def test_several_sites_sources_and_tied_weights_in_one_step_equal_pyvene(models):
  """One pyvene intervention object at two sites (tied weights), each site reading its own
  source, and a second intervention at the same site reading a third: jaxlens's placements
  give pyvene's loss and both rotations' gradients, the tied one's summed over its sites
  (float64, 1e-10), in train_multi's first step."""
  seq, flax_model, variables, site = models
  torch.manual_seed(1)
  tied = pv.RotatedSpaceIntervention(embed_dim=H).double()
  tied.set_interchange_dim(3)
  low = pv.LowRankRotatedSpaceIntervention(embed_dim=H, low_rank_dimension=2).double()
  reps = [("seq.0.output", tied), ("seq.2.output", tied), ("seq.2.output", low)]
  config = pv.IntervenableConfig(
    representations=[
      pv.RepresentationConfig(component=c, unit="pos", max_number_of_units=1, intervention=i)
      for c, i in reps
    ]
  )
  ivm = pv.IntervenableModel(config, _Wrapped(seq))
  ivm.disable_model_gradients()
  rng = np.random.default_rng(7)
  base, *sources = (rng.normal(size=(B, 1, D)) for _ in range(4))
  label = (sources[0][:, 0, 0] > 0).astype(np.int32)
  locations = [[[0]] * B] * 3
  _, out = ivm(
    {"x": torch.from_numpy(base)},
    [{"x": torch.from_numpy(s)} for s in sources],
    {"sources->base": (locations, locations)},
  )
  loss = torch.nn.functional.cross_entropy(out[:, -1], torch.from_numpy(label).long())
  loss.backward()

  params = {"r": torch_bridge.from_pyvene(tied), "low": torch_bridge.from_pyvene(low)}
  ats = [
    jt.At("layers_0", jt.DAS(3), "r", source=0),
    jt.At(site, jt.DAS(3), "r", source=1),
    jt.At(site, jt.LowRankDAS(2), "low", source=2),
  ]
  batch = {"base": base, "sources": sources, "label": label}
  # One compiled step gives both: the first loss, and (plain SGD at rate 1) the gradient as
  # the parameters' change.
  kw = {"steps": 1, "optimizer": optax.sgd(1.0), "progress": False}
  result = jt.train_multi(flax_model, variables, ats, params, [batch], **kw)
  assert abs(result.losses[0] - loss.item()) <= 1e-10
  for name, iv in (("r", tied), ("low", low)):
    want = iv.rotate_layer.parametrizations.weight.original.grad.numpy()
    moved = params[name]["rotation"]["raw"] - result.params[name]["rotation"]["raw"]
    np.testing.assert_allclose(moved, want, atol=1e-10, rtol=0)
  assert sorted(result.params) == ["low", "r"] and result.depends["params"]["r"]["rotation"]["raw"]


def _equality_models():
  """Hierarchical equality (examples/das_hierarchical_equality.py's task) as a causal model,
  in jaxlens and in pyvene."""
  values = {v: [0, 1, 2, 3] for v in "WXYZ"}
  values.update({"WX": [False, True], "YZ": [False, True], "O": [False, True]})
  parents = {"W": [], "X": [], "Y": [], "Z": [], "WX": ["W", "X"], "YZ": ["Y", "Z"]}
  parents["O"] = ["WX", "YZ"]
  functions = {"WX": lambda w, x: w == x, "YZ": lambda y, z: y == z, "O": lambda a, b: a == b}
  ours = jt.CausalModel(values, parents, functions)
  theirs = pv.CausalModel(
    list(values), values, parents, {**{v: (lambda: 0) for v in "WXYZ"}, **functions}
  )
  return ours, theirs


def test_causal_model_runs_and_labels_interchanges_as_pyvene():
  """The same causal model in both: every input's setting, and the counterfactual labels of
  sampled interchanges of one variable and of two, equal pyvene's run_forward and
  run_interchange."""
  ours, theirs = _equality_models()
  assert sorted(ours.inputs) == sorted(theirs.inputs) and ours.outputs == theirs.outputs == ["O"]
  for w, x, y, z in np.ndindex(4, 4, 4, 4):
    inputs = {"W": w, "X": x, "Y": y, "Z": z}
    assert ours.run(inputs) == dict(theirs.run_forward(inputs))
  encode = lambda s: np.asarray([s[v] for v in "WXYZ"], np.float64)  # noqa: E731
  for variables in ("WX", ["WX", "YZ"]):
    batch = ours.counterfactual(40, variables, seed=1, encode=encode)
    names = [variables] if isinstance(variables, str) else variables
    assert batch["base"].shape == (40, 4)
    got = batch["source"][None] if isinstance(variables, str) else np.stack(batch["sources"])
    assert got.shape == (len(names), 40, 4)
    changed = 0
    for i, (base, srcs) in enumerate(zip(batch["inputs"], batch["source_inputs"])):
      want = theirs.run_interchange(base, dict(zip(names, srcs)))["O"]
      assert batch["label"][i] == int(want)
      assert batch["base_label"][i] == int(theirs.run_forward(base)["O"])
      changed += batch["label"][i] != batch["base_label"][i]
    assert changed > 0  # the interchange changes some outputs: the labels are not the base's
