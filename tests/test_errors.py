"""Every typed refusal: code, site and a spelling that works."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlens as jl
from jaxlens import intervention as ji
from jaxlens.intervention import keep_grad
from models_for_tests import MLP, WithDetached, WithIntSite, init

SITE = jl.module("layers_0")


def _trace(spec_model, edit, x=None, site=SITE):
  model, variables, x0, _, _ = spec_model
  return jl.trace(model, variables, x0 if x is None else x, intervene=jl.when(site, edit))


def test_error_is_a_value_error_with_fields(spec_model):
  with pytest.raises(ValueError, match=r"\[unknown_site\]") as info:
    _trace(spec_model, jl.scale(2.0), site=jl.module("layer_0"))
  assert isinstance(info.value, jl.InvalidArgumentError)
  assert isinstance(info.value, jl.SiteError)
  assert info.value.fields["code"] == "unknown_site"
  assert info.value.fields["candidates"][0] == "layers_0"
  assert "layers_0" in info.value.fields["fix"]


def test_unknown_nested_site_lists_the_full_paths():
  model = MLP()
  x = jnp.ones((3, 4))
  v = init(model, x)
  with pytest.raises(jl.SiteError, match="block_1/mlp") as info:
    jl.trace(model, v, x, intervene=jl.when(jl.module("mlp"), jl.scale(2.0)))
  assert set(info.value.fields["candidates"]) >= {"block_0/mlp", "block_1/mlp"}


def test_unknown_save_site(spec_model):
  model, variables, x, _, _ = spec_model
  with pytest.raises(jl.SiteError, match=r"save=.*layers_9"):
    jl.trace(model, variables, x, save=jl.module("layers_9"))


def test_selector_that_matches_nothing_never_passes_silently(spec_model):
  both = jl.module("layers_0") & jl.module("layers_1")
  with pytest.raises(jl.SiteError, match="matched no site"):
    _trace(spec_model, jl.scale(2.0), site=both)


def test_ambiguous_site_on_a_trace(spec_model):
  model, variables, x, _, _ = spec_model
  t = jl.trace(model, variables, x)
  with pytest.raises(jl.SiteError, match=r"\[ambiguous_site\].*2 saved sites") as info:
    t[jl.module("layers_*")]
  assert info.value.fields["candidates"] == ["layers_0", "layers_1"]
  assert np.array_equal(t[jl.module("layers_0")].out, t["layers_0"].out)


@pytest.mark.parametrize(
  "edit, match",
  [
    (lambda: jl.steer(jnp.ones(5), 1.0), r"\[shape_mismatch\].*length 5"),
    (lambda: jl.steer(jnp.ones((2, 4)), 1.0), r"\[shape_mismatch\].*must be 1-D"),
    (lambda: jl.project_out(jnp.ones(3), feature_axis=-1), r"\[shape_mismatch\].*feature_axis"),
    (lambda: jl.patch_from(jnp.ones((2, 4))), r"\[shape_mismatch\].*shape \(2, 4\)"),
    (lambda: jl.replace_with(jnp.ones(5)), r"\[shape_mismatch\].*value has shape \(5,\)"),
    (lambda: jl.replace_with(jnp.ones((3, 4), jnp.int32)), r"\[dtype_mismatch\].*int32"),
    (lambda: jl.patch_from(jnp.ones((3, 4), jnp.float32)), r"\[dtype_mismatch\].*float32"),
    (lambda: jl.add(jnp.ones((2, 4))), r"\[shape_mismatch\].*does not broadcast"),
    (lambda: jl.steer(jnp.ones(4, jnp.bool_), 1.0), r"\[dtype_mismatch\].*float array"),
    (lambda: ji.resample_rows_from(jnp.ones((5, 3)), seed=0), r"\[shape_mismatch\].*rows"),
    (lambda: ji.scramble_elements(seed=0, source=jnp.ones(5)), r"\[shape_mismatch\].*5 elements"),
  ],
)
def test_wrong_shape_or_dtype(spec_model, edit, match):
  with pytest.raises(jl.ShapeError, match=match) as info:
    _trace(spec_model, edit())
  assert info.value.fields["site"] == "layers_0"
  assert "fix" in info.value.fields


@pytest.mark.parametrize("verb", [jl.steer, jl.project_onto, jl.project_out])
def test_ambiguous_feature_axis(spec_model, verb):
  model, variables, _, _, _ = spec_model
  x4 = jnp.ones((4, 4))
  with pytest.raises(jl.InvalidArgumentError, match=r"\[feature_axis_ambiguous\]") as info:
    jl.trace(model, variables, x4, intervene=jl.when(SITE, verb(jnp.arange(1.0, 5.0))))
  assert info.value.fields["candidates"] == [0, 1]
  assert "feature_axis=-1" in info.value.fields["fix"]
  fixed = jl.trace(
    model, variables, x4, intervene=jl.when(SITE, verb(jnp.arange(1.0, 5.0), feature_axis=-1))
  )
  assert fixed.output.shape == (4, 2)


@pytest.mark.parametrize(
  "edit",
  [
    lambda: jl.add_noise(0.1),
    lambda: ji.permute_batch(),
    lambda: ji.scramble_elements(),
    lambda: ji.resample_rows_from(jnp.ones((5, 4))),
  ],
)
def test_random_verb_needs_a_seed(spec_model, edit):
  with pytest.raises(jl.InvalidArgumentError, match=r"\[seed_required\].*explicit seed") as info:
    _trace(spec_model, edit())
  assert "seed=0" in info.value.fields["fix"]


def test_keep_grad_on_a_non_float_site():
  model = WithIntSite()
  x = jnp.ones((3, 4))
  v = init(model, x)
  with pytest.raises(jl.GradientContractError, match=r"\[site_not_float\].*int") as info:
    jl.trace(model, v, x, intervene=jl.when(jl.module("argmax"), keep_grad(jl.scale(1))))
  assert info.value.fields["site"] == "argmax"
  # Without keep_grad an int site can be edited by a cutting verb.
  out = jl.trace(model, v, x, intervene=jl.when(jl.module("argmax"), jl.zero_ablate()))
  assert out["argmax"].out.dtype == jnp.int32 or out["argmax"].out.dtype == jnp.int64


def test_edit_on_a_tuple_site_is_refused():
  model = WithIntSite()
  x = jnp.ones((3, 4))
  v = init(model, x)
  with pytest.raises(jl.InvalidArgumentError, match=r"\[site_not_array\].*tuple"):
    jl.trace(model, v, x, intervene=jl.when(jl.module("pair"), jl.scale(2.0)))


@pytest.mark.parametrize(
  "fn, code",
  [
    (lambda x: x[:2], "hook_shape_mismatch"),
    (lambda x: x.sum(), "hook_shape_mismatch"),
    (lambda x: "nope", "hook_shape_mismatch"),
    (lambda x: x.astype(jnp.float32), "hook_dtype_mismatch"),
  ],
)
def test_hook_returning_the_wrong_shape(spec_model, fn, code):
  with pytest.raises(jl.ShapeError, match=rf"\[{code}\]") as info:
    _trace(spec_model, fn)
  assert info.value.fields["site"] == "layers_0"


def test_edit_detached_names_the_site_and_a_keeping_spelling(spec_model):
  with pytest.raises(jl.GradientContractError, match=r"\[edit_detached_from_graph\]") as info:
    _trace(spec_model, keep_grad(jl.zero_ablate()))
  assert info.value.fields["site"] == "layers_0"
  assert info.value.fields["fix"] == "keep_grad(jl.scale(0.0))"
  with pytest.raises(jl.GradientContractError, match="compose"):
    _trace(spec_model, keep_grad(jl.replace_with(jnp.zeros((3, 4)))))


def test_site_has_no_graph():
  model = WithDetached()
  x = jnp.ones((3, 4))
  v = init(model, x)
  spec = jl.when(jl.module("frozen"), keep_grad(jl.scale(2.0)))
  for f in (
    lambda v: jl.trace(model, v, x, intervene=spec).output,
    jax.jit(lambda v: spec.bind(model)(v, x)),
    lambda v: jax.grad(lambda w: spec.bind(model)(w, x).sum())(v),
  ):
    with pytest.raises(jl.GradientContractError, match=r"\[site_has_no_graph\]") as info:
      f(v)
    assert info.value.fields["site"] == "frozen"
  # The inner Dense does depend on the parameters: keep_grad passes there.
  jl.trace(model, v, x, intervene=jl.when(jl.module("frozen/inner"), keep_grad(jl.scale(2.0))))


def test_site_has_no_graph_when_an_upstream_edit_cut_it(spec_model):
  model, variables, x, _, _ = spec_model
  # With the input frozen and layer 0 zeroed, layers_1 still depends on its own kernel.
  spec = jl.when(SITE, jl.zero_ablate()) + jl.when(jl.module("layers_1"), keep_grad(jl.scale(1.0)))
  jl.trace(model, variables, x, intervene=spec)


def test_grad_disabled(spec_model):
  model, variables, x, _, _ = spec_model
  with jl.no_grad():
    with pytest.raises(jl.GradientContractError, match=r"\[grad_disabled\].*no_grad") as info:
      _trace(spec_model, keep_grad(jl.scale(2.0)))
    assert info.value.fields["site"] == "layers_0"
    g = jax.grad(lambda v: jl.when(SITE, jl.scale(2.0)).bind(model)(v, x).sum())(variables)
  assert all(np.all(leaf == 0) for leaf in jax.tree.leaves(g))
  g = jax.grad(lambda v: jl.when(SITE, jl.scale(2.0)).bind(model)(v, x).sum())(variables)
  assert np.any(g["params"]["layers_0"]["kernel"] != 0)


@pytest.mark.parametrize(
  "call, code, match",
  [
    (lambda m, v, x: jl.when(SITE, object()), "invalid_edit", "expected an edit"),
    (lambda m, v, x: jl.when(3, jl.scale(2.0)), "invalid_site", "selector"),
    (lambda m, v, x: jl.module(3), "invalid_site", "module path string"),
    (lambda m, v, x: jl.module("a", call=0), "invalid_site", "positive int"),
    (lambda m, v, x: jl.trace(m, v, x, intervene="x"), "invalid_spec", "intervene="),
    (lambda m, v, x: jl.trace(lambda y: y, v, x), "invalid_model", "flax.linen or flax.nnx Module"),
    (lambda m, v, x: jl.trace(m), "missing_variables", "variables"),
    (lambda m, v, x: jl.clamp(), "invalid_argument", "min= or max="),
    (lambda m, v, x: ji.compose(), "invalid_argument", "at least one"),
    (lambda m, v, x: jl.InterventionOptions(engine="fast"), "invalid_argument", "engine"),
    (lambda m, v, x: jl.population(), "invalid_source", "at least one"),
    (
      lambda m, v, x: jl.trace(m, v, x, intervene=jl.when(SITE, jl.mean_ablate(source="a"))),
      "invalid_source",
      "source must be",
    ),
    (
      lambda m, v, x: jl.trace(m, v, x, intervene=jl.when(SITE, jl.swap_with("layers_1"))),
      "swap_source_unavailable",
      "already ran",
    ),
    (
      lambda m, v, x: jl.trace(
        m,
        v,
        x,
        intervene=jl.when(SITE, jl.patch_from(jl.trace(m, v, x, save=jl.module("layers_1")))),
      ),
      "donor_site_missing",
      "saved no value",
    ),
  ],
)
def test_bad_arguments(spec_model, call, code, match):
  model, variables, x, _, _ = spec_model
  with pytest.raises(jl.InvalidArgumentError, match=match) as info:
    call(model, variables, x)
  assert info.value.code == code


@pytest.mark.parametrize(
  "wrap",
  [
    lambda e: ji.at_positions(jnp.array([0]), e, axis=0),
    lambda e: ji.compose(jl.scale(1.0), e),
    lambda e: ji.gate(True, e),
  ],
  ids=["at_positions", "compose", "gate"],
)
def test_site_has_no_graph_for_keep_grad_nested_in_another_edit(wrap):
  """Regression: keep_grad inside at_positions skipped the site_has_no_graph probe."""
  model = WithDetached()
  x = jnp.ones((3, 4))
  v = init(model, x)
  spec = jl.when(jl.module("frozen"), wrap(keep_grad(jl.scale(2.0))))
  for f in (
    lambda v: jl.trace(model, v, x, intervene=spec).output,
    lambda v: spec.bind(model)(v, x),
  ):
    with pytest.raises(jl.GradientContractError, match=r"\[site_has_no_graph\]"):
      f(v)


def test_reprs_show_every_argument():
  """Regression: jl.scale(0.5) printed as jl.scale()."""
  assert repr(jl.scale(0.5)) == "jl.scale(0.5)"
  assert repr(keep_grad(jl.clamp(min=-1.0))) == "jl.keep_grad(jl.clamp(min=-1.0))"
  assert repr(jl.steer(np.array([1.0, 2.0]), 3.0, feature_axis=-1)) == (
    "jl.steer(jnp.array([1.0, 2.0], dtype=jnp.float64), magnitude=3.0, feature_axis=-1)"
  )
  assert repr(ji.compose(jl.scale(2.0), jl.zero_ablate())) == (
    "jl.compose(jl.scale(2.0), jl.zero_ablate())"
  )
  assert repr(jl.mean_ablate(dim=0)) == "jl.mean_ablate(dim=0)"
  assert repr(ji.permute_batch(seed=3)) == "jl.permute_batch(seed=3)"
  spec = jl.when(jl.units("layers_0", [1, 3]), jl.add_noise(0.1, seed=0))
  assert repr(spec) == (
    "jl.when(jl.units(jl.label('layers_0'), jnp.array([1, 3], "
    "dtype=jnp.int64)), jl.add_noise(0.1, seed=0))"
  )
  # A repr of plain values is code that builds the same edit.
  edit = jl.clamp(min=-1.0, max=2.0)
  assert repr(eval(repr(edit), {"jl": jl, "jnp": jnp})) == repr(edit)


def _error_classes():
  """Every ``class ...Error`` in jaxlens and torch_bridge, read from the source: name -> bases,
  and whether its body is a docstring only."""
  import ast
  import pathlib

  root = pathlib.Path(__file__).resolve().parents[1]
  found = {}
  for path in [*root.glob("jaxlens/**/*.py"), *root.glob("torch_bridge/**/*.py")]:
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ClassDef) and node.name.endswith("Error"):
        bases = [b.attr if isinstance(b, ast.Attribute) else b.id for b in node.bases]
        doc_only = (
          len(node.body) == 1
          and isinstance(node.body[0], ast.Expr)
          and isinstance(node.body[0].value, ast.Constant)
        )
        found[node.name] = (bases, doc_only, path.relative_to(root))
  return found


def test_one_error_family_with_one_constructor():
  """Every error class is a JaxlensError built by the base constructor (a subclass with a
  docstring only), and docs/errors.md names it."""
  import pathlib

  classes = _error_classes()
  assert {"JaxlensError", "StoreError", "ConversionError", "LoadError"} <= set(classes)
  builtin = {"ValueError", "OSError", "RuntimeError", "ImportError", "TypeError", "Exception"}

  def reaches_base(name):
    return name == "JaxlensError" or any(b in classes and reaches_base(b) for b in classes[name][0])

  docs = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "errors.md").read_text()
  for name, (bases, doc_only, path) in classes.items():
    assert set(bases) <= set(classes) | builtin, (name, bases)
    assert reaches_base(name), f"{path}: {name} is not a JaxlensError"
    if name != "JaxlensError":
      assert doc_only, f"{path}: {name} has a body besides its docstring"
    assert f"`{name}`" in docs or f".{name}`" in docs, f"docs/errors.md: add {name}"


def test_the_base_constructor_formats_every_error_alike():
  from jaxlens.store import StoreError

  error = StoreError(
    "no store here", code="store_missing", site="a/b", fix="collect first", path="p"
  )
  assert str(error) == "[store_missing] no store here (site: a/b)\n  Fix: collect first"
  assert error.code == "store_missing"
  assert error.fields == {
    "code": "store_missing",
    "site": "a/b",
    "fix": "collect first",
    "path": "p",
  }
  assert isinstance(error, OSError) and isinstance(error, jl.JaxlensError)
  with pytest.raises(TypeError, match="code"):
    jl.InvalidArgumentError("no code")
