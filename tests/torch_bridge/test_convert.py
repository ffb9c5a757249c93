"""Tests for the torch -> Flax converter (torch_bridge.convert).

Every converted model is checked three ways against torch, in float64
(tolerance 1e-12) and float32 (1e-5):

* output parity of ``flax_module.apply(variables, x)`` with ``torch(x)``;
* site-map exactness: each mapped Flax path is a module whose ``__call__``
  runs (seen through ``flax.linen.intercept_methods``) and whose output
  equals the torch forward-hook output of the mapped torch module;
* ``variables`` has exactly the tree, shapes and dtypes ``module.init`` makes.
"""

from __future__ import annotations

import collections

import jax

# float64 parity needs 64-bit jax; the whole suite runs with x64 enabled.
jax.config.update("jax_enable_x64", True)

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from torch_bridge.convert import (  # noqa: E402
  ConversionError,
  GPTBlock,
  TinyGPT,
  from_torch,
  to_jax,
  to_torch,
)
from torch_bridge.convert._flax_layers import FlaxLayerNorm  # noqa: E402

TOL = {torch.float64: 1e-12, torch.float32: 1e-5}
tnn = torch.nn

# torch warns that an even kernel with padding="same" pads a copy of the input.
pytestmark = pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel:UserWarning")


# --------------------------------------------------------------------------
# Models under test: name -> factory returning (torch model, example input).
# --------------------------------------------------------------------------


def _x(*shape: int, scale: float = 1.0) -> torch.Tensor:
  return torch.randn(*shape, dtype=torch.float64) * scale


def _tokens(high: int, *shape: int) -> torch.Tensor:
  return torch.randint(0, high, shape)


CASES = {
  "linear": lambda: (tnn.Linear(5, 4), _x(3, 5)),
  "linear_no_bias_3d": lambda: (tnn.Linear(5, 4, bias=False), _x(2, 3, 5)),
  "activations": lambda: (
    tnn.Sequential(
      tnn.ReLU(),
      tnn.GELU(),
      tnn.GELU(approximate="tanh"),
      tnn.Tanh(),
      tnn.Sigmoid(),
      tnn.SiLU(),
      tnn.Identity(),
      tnn.Dropout(0.5),
    ),  # fmt: skip
    _x(4, 6, scale=3.0),
  ),
  "nested_sequential": lambda: (
    tnn.Sequential(
      tnn.Linear(6, 8),
      tnn.ReLU(),
      tnn.Sequential(tnn.Linear(8, 8), tnn.Tanh(), tnn.Sequential(tnn.Linear(8, 3))),
      tnn.SiLU(),
    ),
    _x(3, 6),
  ),
  "named_sequential": lambda: (
    tnn.Sequential(
      collections.OrderedDict(
        fc1=tnn.Linear(4, 8), act=tnn.GELU(), drop=tnn.Dropout(0.1), fc2=tnn.Linear(8, 2)
      )
    ),
    _x(5, 4),
  ),
  "empty_sequential": lambda: (tnn.Sequential(), _x(2, 3)),
  "layer_norm": lambda: (tnn.LayerNorm(6), _x(3, 4, 6, scale=2.0)),
  "layer_norm_2d_eps": lambda: (tnn.LayerNorm((4, 5), eps=1e-3), _x(2, 4, 5)),
  "layer_norm_no_affine": lambda: (tnn.LayerNorm(6, elementwise_affine=False), _x(3, 6)),
  "layer_norm_no_bias": lambda: (tnn.LayerNorm(6, bias=False), _x(3, 6)),
  "embedding": lambda: (tnn.Embedding(10, 4, padding_idx=0), _tokens(10, 3, 5)),
  "conv1d": lambda: (tnn.Conv1d(4, 6, 3), _x(2, 4, 9)),
  "conv1d_stride_dilation_groups": lambda: (
    tnn.Conv1d(4, 6, 3, stride=2, padding=2, dilation=2, groups=2, bias=False),
    _x(2, 4, 11),
  ),
  "conv1d_same_even_kernel": lambda: (tnn.Conv1d(3, 4, 4, padding="same", dilation=1), _x(2, 3, 8)),
  "conv1d_same_dilated": lambda: (tnn.Conv1d(3, 4, 3, padding="same", dilation=3), _x(2, 3, 8)),
  "conv1d_valid": lambda: (tnn.Conv1d(3, 4, 3, padding="valid", stride=2), _x(2, 3, 9)),
  "conv1d_tuple_unbatched": lambda: (tnn.Conv1d(3, 4, 3, padding=(1,)), _x(3, 9)),
  "conv2d": lambda: (tnn.Conv2d(3, 4, 3, padding=1), _x(2, 3, 6, 7)),
  "conv2d_tuples_groups": lambda: (
    tnn.Conv2d(4, 6, (3, 2), stride=(2, 1), padding=(1, 2), dilation=(1, 2), groups=2),
    _x(2, 4, 7, 6),
  ),
  "conv2d_same_no_bias": lambda: (
    tnn.Conv2d(2, 3, (4, 3), padding="same", bias=False),
    _x(2, 2, 5, 6),
  ),
  "conv2d_valid": lambda: (tnn.Conv2d(2, 3, 2, padding="valid", stride=2), _x(1, 2, 6, 6)),
  "conv3d": lambda: (tnn.Conv3d(2, 3, 2, padding=1), _x(1, 2, 3, 4, 4)),
  "conv_stack": lambda: (
    tnn.Sequential(tnn.Conv1d(2, 4, 3, padding=1), tnn.ReLU(), tnn.Conv1d(4, 2, 1)),
    _x(2, 2, 6),
  ),
  "gpt_block": lambda: (GPTBlock(16, 2), _x(3, 7, 16)),
  "gpt_block_attn_dropout_eval": lambda: (_block_with_attn(dropout=0.1), _x(2, 5, 16)),
  "tiny_gpt": lambda: (
    TinyGPT(vocab=11, d_model=16, n_heads=2, n_layers=2, max_len=8),
    _tokens(11, 3, 7),
  ),
}


def _block_with_attn(**mha_kwargs) -> GPTBlock:
  block = GPTBlock(16, 2)
  block.attn = tnn.MultiheadAttention(16, 2, batch_first=True, **mha_kwargs)
  return block


def _make(case: str, dtype: torch.dtype) -> tuple[tnn.Module, torch.Tensor]:
  """Builds a case with random (not default) weights, in eval mode."""
  torch.manual_seed(0)
  model, x = CASES[case]()
  model = model.to(dtype).eval()
  with torch.no_grad():  # default LayerNorm/attention biases are 1s/0s
    for p in model.parameters():
      p.copy_(torch.randn_like(p) * 0.5)
  return model, (x.to(dtype) if x.is_floating_point() else x)


# --------------------------------------------------------------------------
# Recording activations on both sides.
# --------------------------------------------------------------------------


def _torch_outputs(model: tnn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
  """Runs ``model`` and records each module's forward-hook outputs by name."""
  outs: dict[str, list] = collections.defaultdict(list)

  def hook(name):
    def record(module, args, output):
      # MultiheadAttention returns (output, weights); weights is None.
      outs[name].append(output[0] if isinstance(output, tuple) else output)

    return record

  handles = [m.register_forward_hook(hook(name)) for name, m in model.named_modules()]
  try:
    with torch.no_grad():
      y = model(x)
  finally:
    for h in handles:
      h.remove()
  return y, outs


def _flax_outputs(module: nn.Module, variables: dict, x: jax.Array) -> tuple[jax.Array, dict]:
  """Applies ``module`` and records every ``__call__`` output by Flax path."""
  outs: dict[str, list] = collections.defaultdict(list)

  def interceptor(next_fun, args, kwargs, context):
    out = next_fun(*args, **kwargs)
    if context.method_name == "__call__":
      outs["/".join(context.module.path)].append(out)
    return out

  with nn.intercept_methods(interceptor):
    y = module.apply(variables, x)
  return y, outs


def _maxdiff(a, b) -> float:
  a, b = np.asarray(a), np.asarray(b.detach().numpy() if isinstance(b, torch.Tensor) else b)
  assert a.shape == b.shape, (a.shape, b.shape)
  return float(np.max(np.abs(a - b))) if a.size else 0.0


def check_conversion(case: str, dtype: torch.dtype) -> float:
  """Converts a case and checks parity, site map and variables; returns max diff."""
  tol = TOL[dtype]
  model, x = _make(case, dtype)
  module, variables, site_map = from_torch(model)
  torch_y, torch_outs = _torch_outputs(model, x)
  flax_y, flax_outs = _flax_outputs(module, variables, to_jax(x))

  diff = _maxdiff(flax_y, torch_y)
  assert diff <= tol, f"{case}: output max abs diff {diff}"
  assert np.asarray(flax_y).dtype == torch_y.numpy().dtype

  # Site map: every torch module torch calls (not ModuleList) is mapped.
  expected = {n for n, m in model.named_modules() if not isinstance(m, tnn.ModuleList)}
  assert set(site_map) == expected
  assert site_map[""] == ""
  for name, path in site_map.items():
    assert len(flax_outs.get(path, [])) == 1, f"{case}: {path!r} ({name!r}) never/multiply called"
    if name in torch_outs:
      (ref,) = torch_outs[name]
    else:  # torch's MHA never calls out_proj.forward; its output is attn's.
      assert name.endswith(".out_proj"), name
      (ref,) = torch_outs[name.rsplit(".", 1)[0]]
    d = _maxdiff(flax_outs[path][0], ref)
    assert d <= tol, f"{case}: site {name!r} -> {path!r} differs by {d}"

  # Variables: same tree, shapes and dtypes as module.init would create
  # (from_torch always has a "params" entry, init omits an empty one).
  init_shapes = {"params": {}, **jax.eval_shape(module.init, jax.random.key(0), to_jax(x))}
  shape_of = lambda a: (a.shape, jnp.dtype(a.dtype))  # noqa: E731
  assert jax.tree.map(shape_of, init_shapes) == jax.tree.map(shape_of, variables)
  want = jnp.dtype(str(dtype).removeprefix("torch."))
  assert all(leaf.dtype == want for leaf in jax.tree.leaves(variables))
  return diff


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("case", list(CASES))
def test_parity_and_site_map(case, dtype):
  check_conversion(case, dtype)


# --------------------------------------------------------------------------
# Specific behaviours.
# --------------------------------------------------------------------------


def test_site_map_paths_tiny_gpt():
  model = TinyGPT(vocab=11, d_model=16, n_heads=2, n_layers=2, max_len=8)
  _, _, site_map = from_torch(model.eval())
  assert site_map["blocks.1.attn"] == "blocks_1/attn"
  assert site_map["blocks.1.attn.out_proj"] == "blocks_1/attn/out_proj"
  assert site_map["blocks.0.mlp.2"] == "blocks_0/mlp/layers_2"
  assert site_map["head"] == "head"
  assert "blocks" not in site_map  # the ModuleList is never called


def test_site_map_paths_sequential():
  model = tnn.Sequential(tnn.Linear(2, 3), tnn.Sequential(tnn.ReLU(), tnn.Linear(3, 1)))
  _, variables, site_map = from_torch(model)
  assert site_map == {
    "": "",
    "0": "layers_0",
    "1": "layers_1",
    "1.0": "layers_1/layers_0",
    "1.1": "layers_1/layers_1",
  }
  assert set(variables["params"]) == {"layers_0", "layers_1"}
  assert set(variables["params"]["layers_1"]) == {"layers_1"}


def test_tiny_gpt_jit_float32():
  model, idx = _make("tiny_gpt", torch.float32)
  module, variables, _ = from_torch(model)
  with torch.no_grad():
    ref = model(idx)
  out = jax.jit(module.apply)(variables, to_jax(idx))
  assert _maxdiff(out, ref) <= 1e-5


def test_tiny_gpt_rejects_too_long_sequence():
  module, variables, _ = from_torch(TinyGPT(11, 16, 2, 1, max_len=4).eval())
  with pytest.raises(ValueError, match="exceeds max_len 4"):
    module.apply(variables, jnp.zeros((1, 5), jnp.int32))


def test_layer_norm_rejects_wrong_trailing_shape():
  with pytest.raises(ValueError, match=r"expects trailing dims \(4,\)"):
    FlaxLayerNorm((4,)).init(jax.random.key(0), jnp.ones((2, 5)))


def test_dtype_override_to_float32():
  model, x = _make("tiny_gpt", torch.float64)
  module, variables, _ = from_torch(model, dtype=jnp.float32)
  assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(variables))
  with torch.no_grad():
    ref = model(x)
  out = module.apply(variables, to_jax(x))
  assert out.dtype == jnp.float32
  assert _maxdiff(out, ref) <= 1e-5


def test_dtype_override_to_float64_with_torch_dtype():
  model, x = _make("conv2d", torch.float32)
  module, variables, _ = from_torch(model, dtype=torch.float64)
  assert all(leaf.dtype == jnp.float64 for leaf in jax.tree.leaves(variables))
  with torch.no_grad():
    ref = model(x)
  assert _maxdiff(module.apply(variables, to_jax(x.double())), ref) <= 1e-5


def test_bfloat16_parameters_are_kept():
  model = tnn.Linear(3, 2).to(torch.bfloat16)
  _, variables, _ = from_torch(model)
  kernel = variables["params"]["kernel"]
  assert kernel.dtype == jnp.bfloat16
  np.testing.assert_array_equal(
    np.asarray(kernel, np.float32), model.weight.detach().float().numpy().T
  )


def test_weights_are_copied_not_shared():
  model = tnn.Linear(3, 2)
  _, variables, _ = from_torch(model)
  before = np.array(variables["params"]["kernel"])
  with torch.no_grad():
    model.weight.add_(1.0)
  np.testing.assert_array_equal(np.asarray(variables["params"]["kernel"]), before)


def test_subclass_keeping_forward_is_accepted():
  class MyLinear(tnn.Linear):
    pass

  model, x = MyLinear(3, 2).double(), _x(4, 3)
  module, variables, _ = from_torch(model)
  with torch.no_grad():
    ref = model(x)
  assert _maxdiff(module.apply(variables, to_jax(x)), ref) <= 1e-12


# --------------------------------------------------------------------------
# Errors: every code, fields and message.
# --------------------------------------------------------------------------


class Doubler(tnn.Module):
  def forward(self, x):
    return 2 * x


class LinearPlusOne(tnn.Linear):
  def forward(self, x):
    return super().forward(x) + 1


def _raises(model, match: str, **kwargs) -> dict:
  """Asserts from_torch(model) raises ConversionError matching ``match``; returns fields."""
  with pytest.raises(ConversionError, match=match) as info:
    from_torch(model, **kwargs)
  return info.value.fields


def _bad(attribute: str, value: str, supported: str) -> str:
  """The regex of an unsupported-attribute message (arguments are regexes)."""
  return rf"attribute {attribute}={value} is not supported; supported: {supported}"


def _attr_fields(fields: dict, module: str, type_: str, attribute: str) -> None:
  assert fields["code"] == "unsupported_attribute"
  assert (fields["module"], fields["type"], fields["attribute"]) == (module, type_, attribute)
  assert fields["supported"]


def test_conversion_error_is_value_error():
  assert issubclass(ConversionError, ValueError)
  assert ConversionError("msg", code="x").fields == {"code": "x"}


def test_unsupported_module_custom():
  fields = _raises(
    tnn.Sequential(tnn.Linear(2, 2), Doubler()),
    r"module '1' \(Doubler\): module type Doubler is not supported\. "
    r"Supported types: Linear, Sequential, ",
  )
  assert fields == {"code": "unsupported_module", "module": "1", "type": "Doubler"}


def test_unsupported_module_torch_type():
  fields = _raises(tnn.BatchNorm1d(3), r"<root> \(BatchNorm1d\): module type BatchNorm1d is not")
  assert fields == {"code": "unsupported_module", "module": "", "type": "BatchNorm1d"}


def test_unsupported_module_bare_module_list():
  fields = _raises(tnn.ModuleList([tnn.ReLU()]), "module type ModuleList is not supported")
  assert fields["code"] == "unsupported_module"


def test_unsupported_module_subclass_overriding_forward():
  fields = _raises(
    tnn.Sequential(LinearPlusOne(2, 2)),
    r"'0' \(LinearPlusOne\): subclass of Linear overrides forward\(\)",
  )
  assert fields == {"code": "unsupported_module", "module": "0", "type": "LinearPlusOne"}


def test_unsupported_module_standalone_multihead_attention():
  fields = _raises(
    tnn.MultiheadAttention(8, 2, batch_first=True),
    r"MultiheadAttention is only supported as the `attn` of a GPTBlock",
  )
  assert fields == {"code": "unsupported_module", "module": "", "type": "MultiheadAttention"}


def test_unsupported_module_gpt_block_attn_replaced():
  block = GPTBlock(8, 2)
  block.attn = tnn.Identity()
  fields = _raises(block, r"'attn' \(Identity\): GPTBlock.attn must be an nn.MultiheadAttention")
  assert fields == {"code": "unsupported_module", "module": "attn", "type": "Identity"}


def test_unsupported_attribute_conv_padding_mode():
  fields = _raises(
    tnn.Sequential(tnn.Conv2d(2, 2, 3, padding=1, padding_mode="reflect")),
    r"'0' \(Conv2d\): " + _bad("padding_mode", "'reflect'", "'zeros'"),
  )
  _attr_fields(fields, "0", "Conv2d", "padding_mode")
  assert fields["value"] == "reflect"


def test_unsupported_attribute_dropout_training():
  fields = _raises(
    tnn.Sequential(tnn.Linear(2, 2), tnn.Dropout(0.1)).train(),
    r"'1' \(Dropout\): " + _bad("training", "True", "Dropout in eval mode only"),
  )
  _attr_fields(fields, "1", "Dropout", "training")


def test_unsupported_attribute_gelu_approximate():
  gelu = tnn.GELU()
  gelu.approximate = "erf"
  fields = _raises(gelu, _bad("approximate", "'erf'", "'none' or 'tanh'"))
  _attr_fields(fields, "", "GELU", "approximate")


def test_unsupported_attribute_embedding_max_norm():
  fields = _raises(tnn.Embedding(5, 3, max_norm=1.0), _bad("max_norm", r"1\.0", "max_norm=None"))
  _attr_fields(fields, "", "Embedding", "max_norm")


def test_unsupported_attribute_unknown_instance_attribute():
  lin = tnn.Linear(2, 2)
  lin.temperature = 2.0
  fields = _raises(
    lin, _bad("temperature", r"2\.0", "only the attributes: in_features, out_features")
  )
  _attr_fields(fields, "", "Linear", "temperature")


def test_unsupported_attribute_buffer_parameter_child():
  lin = tnn.Linear(2, 2)
  lin.register_buffer("mask", torch.ones(2))
  fields = _raises(lin, _bad("mask", "'<buffer>'", "no buffers"))
  _attr_fields(fields, "", "Linear", "mask")

  lin = tnn.Linear(2, 2)
  lin.register_parameter("gain", tnn.Parameter(torch.ones(2)))
  fields = _raises(lin, _bad("gain", "'<parameter>'", "only the parameters: weight, bias"))
  _attr_fields(fields, "", "Linear", "gain")

  lin = tnn.Linear(2, 2)
  lin.act = tnn.ReLU()
  fields = _raises(lin, _bad("act", "'ReLU'", "only the children: none"))
  _attr_fields(fields, "", "Linear", "act")


def test_unsupported_attribute_deep_inside_tiny_gpt():
  model = TinyGPT(11, 8, 2, 1, max_len=4).eval()
  model.blocks[0].ln1.note = "x"
  fields = _raises(model, r"'blocks\.0\.ln1' \(LayerNorm\): " + _bad("note", "'x'", "only the"))
  _attr_fields(fields, "blocks.0.ln1", "LayerNorm", "note")


@pytest.mark.parametrize(
  "kwargs, attribute, match",
  [
    ({"batch_first": False}, "batch_first", _bad("batch_first", "False", "True")),
    ({"add_bias_kv": True}, "bias_k", _bad("bias_k", "'<parameter>'", "add_bias_kv=False")),
    ({"add_zero_attn": True}, "add_zero_attn", _bad("add_zero_attn", "True", "False")),
    ({"kdim": 4, "vdim": 4}, "kdim/vdim", _bad("kdim/vdim", r"\(4, 4\)", "kdim == vdim")),
  ],
)
def test_unsupported_attribute_attention_options(kwargs, attribute, match):
  block = GPTBlock(16, 2)
  block.attn = tnn.MultiheadAttention(16, 2, **{"batch_first": True, **kwargs})
  fields = _raises(block.eval(), r"'attn' \(MultiheadAttention\): " + match)
  _attr_fields(fields, "attn", "MultiheadAttention", attribute)


def test_unsupported_attribute_attention_dropout_in_training():
  fields = _raises(
    _block_with_attn(dropout=0.1).train(),
    r"'attn' \(MultiheadAttention\): " + _bad("training", "True", r"eval mode or dropout=0\.0"),
  )
  _attr_fields(fields, "attn", "MultiheadAttention", "training")
  from_torch(GPTBlock(16, 2).train())  # dropout=0.0: training mode is harmless


def test_unsupported_attribute_tiny_gpt_blocks_not_module_list():
  model = TinyGPT(11, 8, 2, 1, max_len=4)
  model.blocks = tnn.Sequential(*model.blocks)
  fields = _raises(model, _bad("blocks", "'Sequential'", "an nn.ModuleList"))
  _attr_fields(fields, "", "TinyGPT", "blocks")


def test_shared_module():
  lin = tnn.Linear(3, 3)
  fields = _raises(
    tnn.Sequential(lin, tnn.ReLU(), lin),
    r"'2' \(Linear\): the same module instance is also used as '0'",
  )
  assert fields == {"code": "shared_module", "module": "2", "type": "Linear"}


@pytest.mark.parametrize("dtype", [jnp.int32, "not-a-dtype", torch.int64])
def test_unsupported_dtype_argument(dtype):
  fields = _raises(tnn.Linear(2, 2), r"dtype=.* is not supported; supported: None", dtype=dtype)
  assert fields["code"] == "unsupported_dtype" and fields["type"] == "Linear"
  assert fields["attribute"] == "dtype"


def test_unsupported_dtype_float64_without_x64():
  jax.config.update("jax_enable_x64", False)
  try:
    fields = _raises(tnn.Linear(2, 2).double(), r"64-bit parameters need jax_enable_x64")
    from_torch(tnn.Linear(2, 2).double(), dtype=jnp.float32)  # explicit float32 is fine
  finally:
    jax.config.update("jax_enable_x64", True)
  assert fields == {
    "code": "unsupported_dtype",
    "module": "",
    "type": "Linear",
    "fix": 'enable it with jax.config.update("jax_enable_x64", True) or pass dtype=jnp.float32',
  }


def test_non_module_is_type_error():
  with pytest.raises(TypeError, match="expects a torch.nn.Module"):
    from_torch(lambda x: x)


# --------------------------------------------------------------------------
# to_jax / to_torch.
# --------------------------------------------------------------------------


def test_round_trip_float32_zero_copy():
  t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
  a = to_jax(t)
  assert a.dtype == jnp.float32 and a.shape == (3, 4)
  np.testing.assert_array_equal(np.asarray(a), t.numpy())
  # On CPU, DLPack import is zero-copy for aligned contiguous tensors.
  assert a.unsafe_buffer_pointer() == t.data_ptr()
  back = to_torch(a)
  assert back.data_ptr() == t.data_ptr()
  assert torch.equal(back, t)


def test_to_torch_zero_copy_from_jax():
  a = jnp.arange(6.0).reshape(2, 3)
  t = to_torch(a)
  assert t.dtype == torch.float64
  assert t.data_ptr() == a.unsafe_buffer_pointer()
  np.testing.assert_array_equal(t.numpy(), np.asarray(a))


def test_to_jax_requires_grad_and_non_contiguous():
  g = torch.randn(3, 4, requires_grad=True)
  np.testing.assert_array_equal(np.asarray(to_jax(g)), g.detach().numpy())
  nc = torch.randn(4, 5).t()
  assert not nc.is_contiguous()
  np.testing.assert_array_equal(np.asarray(to_jax(nc)), nc.numpy())


def test_round_trip_dtypes():
  for t in [torch.randn(3, dtype=torch.float64), torch.arange(5), torch.tensor([True, False])]:
    a = to_jax(t)
    assert str(a.dtype) == str(t.dtype).removeprefix("torch.")
    assert torch.equal(to_torch(a), t)
  bf = torch.randn(4).to(torch.bfloat16)
  a = to_jax(bf)
  assert a.dtype == jnp.bfloat16
  assert torch.equal(to_torch(a), bf)


def test_to_torch_numpy_and_type_errors():
  host = np.arange(4.0)
  t = to_torch(host)
  assert t.data_ptr() == host.ctypes.data  # shares the writable numpy buffer
  readonly = np.arange(3.0)
  readonly.flags.writeable = False
  assert torch.equal(to_torch(readonly), torch.arange(3.0, dtype=torch.float64))
  tensor = torch.ones(2)
  assert to_torch(tensor) is tensor
  with pytest.raises(TypeError, match="expects a torch.Tensor"):
    to_jax(np.ones(2))


class _Doubler(tnn.Module):
  def forward(self, x):
    return 2 * x


def test_auto_chooses_the_path_by_a_predicate(monkeypatch):
  """method="auto" asks ``handles`` (the converters on shapes, nothing copied) and runs one
  path; it no longer starts the fast path and falls back when it fails."""
  from torch_bridge.convert import _modules

  known = tnn.Sequential(tnn.Linear(3, 4), tnn.ReLU())
  unknown = tnn.Sequential(tnn.Linear(3, 3), _Doubler())
  assert _modules.handles(known) and not _modules.handles(unknown)
  assert not _modules.handles(tnn.Sequential(tnn.GELU(approximate="tanh"), tnn.Dropout(0.5)))
  real, fast = _modules.from_torch, []
  monkeypatch.setattr(_modules, "from_torch", lambda m, **kw: fast.append(m) or real(m, **kw))
  x = torch.randn(2, 3)
  from_torch(known, x)
  _, variables, _ = from_torch(unknown, x)
  assert fast == [known]  # the unknown model went straight to the export path
  assert variables["params"]
