"""Selection doors (units, subspace), at_positions, subspace edits, trainable subspaces."""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxlens as jl
from jaxlens import intervention as ji

SITE = jl.module("layers_0")


def _site(t):
  return t["layers_0"].out


def _basis(seed=0, d=4, k=2):
  return ji.orthonormal(jnp.asarray(np.random.RandomState(seed).randn(d, k)))


def test_units_write_only_the_selected_elements_on_every_door(spec_model, tmp_path):
  model, v, x, _, _ = spec_model
  clean = jl.trace(model, v, x)
  mask = jnp.asarray(
    [[True, False, False, True], [False, True, False, False], [False, False, True, True]]
  )  # differs between rows
  sel = jl.units(SITE, mask)
  want = jnp.where(mask, 0.0, _site(clean))
  live = jl.trace(model, v, x, intervene=jl.when(sel, jl.zero_ablate()))
  results = [
    live,
    clean.do(sel, jl.zero_ablate()),
    clean.do(sel, jl.zero_ablate(), model=model.bind(v), inputs=x),
    clean.do(sel, jl.zero_ablate(), intervention=jl.InterventionOptions(engine="set_only")).run(),
    clean.do(sel, jl.zero_ablate(), intervention=jl.InterventionOptions(differentiable=True)),
  ]
  for r in results:
    assert np.array_equal(_site(r), want)
  spec = jl.load_spec(jl.when(sel, jl.zero_ablate()).save(tmp_path / "s"))
  assert np.array_equal(spec.bind(model)(v, x), live.output)
  assert np.array_equal(jl.when(sel, jl.zero_ablate()).bind(model)(v, x), live.output)


def test_cutting_verb_under_units_keeps_the_gradient_of_the_rest(spec_model):
  model, v, x, _, _ = spec_model
  f = lambda v, sel: jl.when(sel, jl.zero_ablate()).bind(model)(v, x).sum()
  g_all = jax.grad(f)(v, jl.units(SITE, jnp.ones((3, 4), bool)))
  g_some = jax.grad(f)(v, jl.units(SITE, jnp.asarray([0, 1])))
  assert np.all(g_all["params"]["layers_0"]["kernel"] == 0)
  k = g_some["params"]["layers_0"]["kernel"]
  assert np.all(k[:, :2] == 0) and np.all(k[:, 2:] != 0)
  # keep_grad passes: what the selection writes depends on the site value.
  jl.trace(
    model, v, x, intervene=jl.when(jl.units(SITE, jnp.asarray([0])), ji.keep_grad(jl.zero_ablate()))
  )


def test_units_index_forms_agree(spec_model):
  model, v, x, _, _ = spec_model
  run = lambda idx: _site(
    jl.trace(model, v, x, intervene=jl.when(jl.units(SITE, idx), jl.scale(0.0)))
  )
  by_mask = run(jnp.asarray([[False, True, False, False]] * 3))
  by_feature = run(jnp.asarray([1]))
  by_tuples = run([(0, 1), (1, 1), (2, 1)])
  assert np.array_equal(by_mask, by_feature) and np.array_equal(by_mask, by_tuples)


def test_vmap_over_indices_and_bases(spec_model):
  model, v, x, _, _ = spec_model
  idx = jnp.asarray([[0], [1], [3]])
  f = lambda i: jl.when(jl.units(SITE, i), jl.zero_ablate()).bind(model)(v, x)
  np.testing.assert_allclose(jax.vmap(f)(idx), jnp.stack([f(i) for i in idx]), atol=1e-12)
  bases = jnp.stack([_basis(s) for s in range(3)])
  g = lambda b: jl.when(jl.subspace(SITE, b), jl.zero_ablate()).bind(model)(v, x)
  np.testing.assert_allclose(jax.vmap(g)(bases), jnp.stack([g(b) for b in bases]), atol=1e-12)
  # Under jit, new indices and bases do not recompile.
  chex.clear_trace_counter()
  h = jax.jit(chex.assert_max_traces(n=1)(lambda b: g(b)))
  h(bases[0]), h(bases[1])


def test_subspace_projection_semantics(spec_model):
  model, v, x, _, _ = spec_model
  clean = _site(jl.trace(model, v, x))
  B = _basis()
  o = jnp.asarray([0.1, -0.2, 0.3, 0.0])
  P = B @ B.T
  for edit, coords in [(jl.zero_ablate(), lambda c: 0 * c), (jl.scale(3.0), lambda c: 3 * c)]:
    got = _site(jl.trace(model, v, x, intervene=jl.when(jl.subspace(SITE, B, origin=o), edit)))
    c = (clean - o) @ B
    np.testing.assert_allclose(got, clean + (coords(c) - c) @ B.T, atol=1e-12)
    # The complement is unchanged; the coordinates are the edited ones.
    np.testing.assert_allclose(
      (got - o) @ (jnp.eye(4) - P), (clean - o) @ (jnp.eye(4) - P), atol=1e-12
    )
    np.testing.assert_allclose((got - o) @ B, coords(c), atol=1e-12)


def test_complement_is_bit_for_bit_unchanged_outside_the_basis_support(spec_model):
  model, v, x, x_donor, _ = spec_model
  clean = jl.trace(model, v, x)
  donor = jl.trace(model, v, x_donor)
  axes = jnp.asarray([[0.0], [1.0], [0.0], [0.0]])  # spans feature 1 only
  got = _site(
    jl.trace(model, v, x, intervene=jl.when(jl.subspace(SITE, axes), jl.patch_from(donor)))
  )
  keep = np.asarray([0, 2, 3])
  assert np.array_equal(np.asarray(got)[:, keep], np.asarray(_site(clean))[:, keep])
  np.testing.assert_allclose(got[:, 1], _site(donor)[:, 1], atol=0)
  # The null patch is the identity, bit for bit, for any basis.
  null = jl.trace(
    model, v, x, intervene=jl.when(jl.subspace(SITE, _basis(3)), jl.patch_from(clean))
  )
  assert np.array_equal(_site(null), _site(clean))


def test_origin_forms(spec_model):
  model, v, x, x_donor, _ = spec_model
  donor = jl.trace(model, v, x_donor)
  pop = jl.population(donor, site=SITE)
  mean = _site(donor).mean(0)
  B = _basis(1)
  run = lambda o: _site(
    jl.trace(model, v, x, intervene=jl.when(jl.subspace(SITE, B, origin=o), jl.zero_ablate()))
  )
  np.testing.assert_allclose(run(pop), run(mean), atol=1e-12)
  np.testing.assert_allclose(run(jnp.broadcast_to(mean, (3, 4))), run(mean), atol=1e-12)
  assert not np.allclose(run(None), run(mean))


def test_non_orthonormal_basis_projects_onto_its_span(spec_model):
  model, v, x, _, _ = spec_model
  B = _basis(2)
  mixed = B @ jnp.asarray([[2.0, 1.0], [0.0, 0.5]])  # same span, not orthonormal
  run = lambda basis: _site(
    jl.trace(model, v, x, intervene=jl.when(jl.subspace(SITE, basis), jl.zero_ablate()))
  )
  np.testing.assert_allclose(run(mixed), run(B), atol=1e-12)
  with pytest.raises(jl.InvalidArgumentError, match=r"\[basis_rank_deficient\]"):
    run(jnp.concatenate([B[:, :1], 2 * B[:, :1]], axis=1))


def test_subspace_edit_family_and_affine(spec_model):
  model, v, x, x_donor, _ = spec_model
  clean = _site(jl.trace(model, v, x))
  donor = jl.trace(model, v, x_donor)
  B = _basis(4)
  run = lambda edit: _site(jl.trace(model, v, x, intervene=jl.when(SITE, edit)))
  sub = lambda e: _site(jl.trace(model, v, x, intervene=jl.when(jl.subspace(SITE, B), e)))
  np.testing.assert_allclose(run(ji.subspace_zero(B)), sub(jl.zero_ablate()), atol=1e-12)
  np.testing.assert_allclose(run(ji.subspace_scale(B, 2.0)), sub(jl.scale(2.0)), atol=1e-12)
  np.testing.assert_allclose(
    run(ji.subspace_patch(B, donor)), sub(jl.patch_from(donor)), atol=1e-12
  )
  coords = jnp.asarray([1.0, -1.0])
  got = run(ji.subspace_set(B, coords))
  np.testing.assert_allclose(got @ B, jnp.broadcast_to(coords, (3, 2)), atol=1e-12)
  # set_affine_coordinates: c := W x + b (LoReFT: x + B (W x + b - Bᵀ x)).
  Wm = jnp.arange(8.0).reshape(2, 4) / 10
  b = jnp.asarray([0.5, -0.5])
  got = sub(ji.set_affine_coordinates(Wm, b))
  np.testing.assert_allclose(got, clean + (clean @ Wm.T + b - clean @ B) @ B.T, atol=1e-12)
  # The subspace edits keep the graph through the complement.
  for edit in (ji.subspace_zero(B), ji.subspace_patch(B, donor)):
    jl.trace(model, v, x, intervene=jl.when(SITE, ji.keep_grad(edit)))


def test_at_positions(spec_model):
  x = jnp.arange(24.0).reshape(2, 3, 4)
  got = jl.at_positions(jnp.asarray([0, 2]), jl.scale(-1.0))(x)
  assert np.array_equal(got[:, 1], x[:, 1])
  assert np.array_equal(got[:, [0, 2]], -x[:, [0, 2]])
  # It composes with other verbs and keeps the graph when its inner verb does.
  composed = ji.compose(jl.at_positions(jnp.asarray([1]), jl.zero_ablate()), jl.add(1.0))
  assert np.array_equal(composed(x)[:, 1], jnp.ones((2, 4)))
  assert jl.depends_on(lambda y: jl.at_positions(jnp.asarray([1]), jl.scale(2.0))(y)[:, 1], x)
  g = jax.grad(lambda y: jl.at_positions(jnp.asarray([1]), jl.zero_ablate())(y).sum())(x)
  assert np.all(g[:, 1] == 0) and np.all(g[:, [0, 2]] == 1)
  # vmap over positions is one call equal to a loop.
  sweep = jax.vmap(lambda p: jl.at_positions(p, jl.zero_ablate())(x))(jnp.asarray([[0], [2]]))
  assert np.array_equal(sweep[1], jl.at_positions(jnp.asarray([2]), jl.zero_ablate())(x))


@pytest.mark.parametrize(
  "make, code",
  [
    (lambda: jl.units(SITE, jnp.asarray([4])), "index_out_of_range"),
    (lambda: jl.units(SITE, [(0, 9)]), "index_out_of_range"),
    (lambda: jl.units(SITE, jnp.zeros((3, 4), bool)), "empty_selection"),
    (lambda: jl.units(SITE, jnp.zeros((0,), jnp.int32)), "empty_selection"),
    (lambda: jl.units(SITE, jnp.ones((2, 4), bool)), "shape_mismatch"),
    (lambda: jl.units(SITE, jnp.ones((3, 4))), "dtype_mismatch"),
    (lambda: jl.subspace(SITE, jnp.ones((5, 2))), "shape_mismatch"),
    (lambda: jl.subspace(SITE, jnp.ones((4,))), "shape_mismatch"),
    (lambda: jl.subspace(SITE, jnp.zeros((4, 0))), "empty_selection"),
    (lambda: jl.subspace(SITE, _basis(), origin=jnp.ones(3)), "shape_mismatch"),
  ],
)
def test_bad_selections(spec_model, make, code):
  model, v, x, _, _ = spec_model
  with pytest.raises(jl.InvalidArgumentError, match=rf"\[{code}\]") as info:
    jl.trace(model, v, x, intervene=jl.when(make(), jl.zero_ablate()))
  assert info.value.fields["site"] == "layers_0"


def test_row_coherent_verbs_need_the_same_mask_in_every_row(spec_model):
  model, v, x, _, _ = spec_model
  per_row = jnp.asarray(
    [[True, False, False, False], [False, True, False, False], [False, False, True, False]]
  )
  with pytest.raises(jl.InvalidArgumentError, match=r"\[mask_not_row_equivariant\]"):
    jl.trace(model, v, x, intervene=jl.when(jl.units(SITE, per_row), ji.permute_batch(seed=0)))
  jl.trace(
    model, v, x, intervene=jl.when(jl.units(SITE, jnp.asarray([0, 2])), ji.permute_batch(seed=0))
  )


def test_subspace_refusals(spec_model):
  model, v, x, _, _ = spec_model
  for verb in (jl.project_onto, jl.project_out):
    with pytest.raises(jl.InvalidArgumentError, match=r"\[subspace_edit_unsupported\]"):
      jl.trace(model, v, x, intervene=jl.when(jl.subspace(SITE, _basis()), verb(jnp.ones(4))))
  affine = ji.set_affine_coordinates(jnp.zeros((2, 4)), jnp.zeros(2))
  for site in (SITE, jl.units(SITE, jnp.asarray([0]))):
    with pytest.raises(jl.InvalidArgumentError, match=r"\[affine_source_needs_subspace\]"):
      jl.trace(model, v, x, intervene=jl.when(site, affine))
  with pytest.raises(jl.ShapeError, match="set_affine_coordinates"):
    jl.trace(
      model,
      v,
      x,
      intervene=jl.when(
        jl.subspace(SITE, _basis()), ji.set_affine_coordinates(jnp.zeros((3, 4)), jnp.zeros(3))
      ),
    )


class _Toy(nn.Module):
  """A frozen toy model: y = readout(tanh(M [a, b])), hidden width 6."""

  @nn.compact
  def __call__(self, ab):
    h = nn.Dense(6, name="hidden", param_dtype=jnp.float64)(ab)
    return nn.Dense(1, name="readout", param_dtype=jnp.float64)(jnp.tanh(h))


def test_trainable_subspace_das_style_rotation_loss_falls():
  """Distributed alignment search: train a 1-D subspace of the hidden layer so that
  patching it from a source run makes the output the counterfactual f(a_src, b_base)."""
  model = _Toy()
  key = jax.random.key(0)
  base = jax.random.normal(key, (64, 2))
  src = jax.random.normal(jax.random.key(1), (64, 2))
  v = model.init(key, base)
  counterfactual = model.apply(v, jnp.stack([src[:, 0], base[:, 1]], axis=1))
  donor = jl.trace(model, v, src, save=jl.module("hidden"))

  def loss(raw):
    basis = ji.orthonormal(raw)
    spec = jl.when(jl.subspace(jl.module("hidden"), basis), jl.patch_from(donor))
    return jnp.mean((spec.bind(model)(v, base) - counterfactual) ** 2)

  raw = jax.random.normal(jax.random.key(2), (6, 1))
  opt = optax.adam(0.05)
  state = opt.init(raw)

  @jax.jit
  def step(raw, state):
    value, grad = jax.value_and_grad(loss)(raw)
    # optax.adam's bias correction raises a float to its int32 step count, which strict
    # dtype promotion (tests/conftest.py) refuses: only the optimiser runs under standard.
    with jax.numpy_dtype_promotion("standard"):
      updates, state = opt.update(grad, state)
    return optax.apply_updates(raw, updates), state, value

  first = loss(raw)
  for _ in range(150):
    raw, state, value = step(raw, state)
  basis = ji.orthonormal(raw)
  np.testing.assert_allclose(basis.T @ basis, jnp.eye(1), atol=1e-10)
  assert loss(raw) < 0.5 * first
  # The model stayed frozen: only the basis was a training argument.
  assert jax.tree.structure(raw) == jax.tree.structure(jnp.zeros((6, 1)))


def test_trainable_loreft_affine_loss_falls():
  model = _Toy()
  x = jax.random.normal(jax.random.key(3), (64, 2))
  v = model.init(jax.random.key(0), x)
  target = model.apply(v, x) + 1.0

  def loss(p):
    spec = jl.when(
      jl.subspace(jl.module("hidden"), ji.orthonormal(p["R"])),
      ji.set_affine_coordinates(p["W"], p["b"]),
    )
    return jnp.mean((spec.bind(model)(v, x) - target) ** 2)

  p = {"R": jax.random.normal(jax.random.key(4), (6, 2)), "W": jnp.zeros((2, 6)), "b": jnp.zeros(2)}
  opt = optax.adam(0.05)
  state = opt.init(p)
  first = loss(p)

  @jax.jit
  def step(p, s):
    g = jax.grad(loss)(p)
    # optax.adam's bias correction raises a float to its int32 step count, which strict
    # dtype promotion (tests/conftest.py) refuses: only the optimiser runs under standard.
    with jax.numpy_dtype_promotion("standard"):
      updates, s = opt.update(g, s)
    return optax.apply_updates(p, updates), s

  for _ in range(100):
    p, state = step(p, state)
  assert loss(p) < 0.2 * first
