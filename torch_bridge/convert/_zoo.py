"""Small, randomly initialised torch models that the converter is checked on.

Each entry of :data:`ZOO` builds ``(model, example_inputs, site)``: the torch model in eval
mode, a tuple of example inputs, and a middle module whose output is a tensor (the site the
intervention checks edit). Shared by the tests, the parity table generator
(``python -m torch_bridge.convert``) and ``benchmarks/bench_convert.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["ZOO", "build"]


def _quiet_transformers():
  # Small configs trip the token-id range warnings of transformers' config checks.
  logging.getLogger("transformers").setLevel(logging.ERROR)
  from transformers.utils import logging as tlog

  tlog.set_verbosity_error()


def gpt2(attn: str = "eager"):
  _quiet_transformers()
  from transformers import GPT2Config, GPT2LMHeadModel

  cfg = GPT2Config(
    n_layer=2,
    n_embd=16,
    n_head=2,
    vocab_size=37,
    n_positions=16,
    use_cache=False,
    bos_token_id=0,
    eos_token_id=0,
  )
  cfg._attn_implementation = attn
  model = GPT2LMHeadModel(cfg)
  return model, (torch.randint(0, 37, (2, 5)),), "transformer.h.0.mlp"


def llama(attn: str = "eager"):
  _quiet_transformers()
  from transformers import LlamaConfig, LlamaForCausalLM

  cfg = LlamaConfig(
    vocab_size=37,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=16,
    use_cache=False,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=0,
  )
  cfg._attn_implementation = attn
  model = LlamaForCausalLM(cfg)
  return model, (torch.randint(0, 37, (2, 5)),), "model.layers.0.mlp"


def bert(attn: str = "eager"):
  _quiet_transformers()
  from transformers import BertConfig, BertModel

  cfg = BertConfig(
    vocab_size=37,
    hidden_size=16,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=32,
    max_position_embeddings=16,
    pad_token_id=0,
  )
  cfg._attn_implementation = attn
  model = BertModel(cfg, add_pooling_layer=True)
  return model, (torch.randint(0, 37, (2, 5)),), "encoder.layer.0.intermediate"


class BasicBlock(nn.Module):
  """The torchvision ResNet basic block."""

  def __init__(self, cin: int, cout: int, stride: int = 1):
    super().__init__()
    self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
    self.bn1 = nn.BatchNorm2d(cout)
    self.relu = nn.ReLU(inplace=True)
    self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
    self.bn2 = nn.BatchNorm2d(cout)
    self.downsample = None
    if stride != 1 or cin != cout:
      self.downsample = nn.Sequential(
        nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
      )

  def forward(self, x):
    identity = x if self.downsample is None else self.downsample(x)
    out = self.relu(self.bn1(self.conv1(x)))
    out = self.bn2(self.conv2(out))
    out += identity
    return self.relu(out)


class ResNet18(nn.Module):
  """torchvision's ResNet-18 layout (2-2-2-2 basic blocks), with a width parameter."""

  def __init__(self, width: int = 8, classes: int = 10):
    super().__init__()
    self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
    self.bn1 = nn.BatchNorm2d(width)
    self.relu = nn.ReLU(inplace=True)
    self.maxpool = nn.MaxPool2d(3, 2, 1)
    widths = [width, 2 * width, 4 * width, 8 * width]
    cin = width
    for i, w in enumerate(widths):
      stride = 1 if i == 0 else 2
      setattr(self, f"layer{i + 1}", nn.Sequential(BasicBlock(cin, w, stride), BasicBlock(w, w)))
      cin = w
    self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
    self.fc = nn.Linear(cin, classes)

  def forward(self, x):
    x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
    x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
    return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet18():
  return ResNet18(), (torch.randn(2, 3, 16, 16),), "layer2.0"


class RNNHead(nn.Module):
  def __init__(self, kind: str):
    super().__init__()
    cls = {"lstm": nn.LSTM, "gru": nn.GRU}[kind]
    self.embed = nn.Linear(6, 6)
    self.rnn = cls(6, 8, num_layers=2, batch_first=True)
    self.head = nn.Linear(8, 3)

  def forward(self, x):
    out, _ = self.rnn(self.embed(x))
    return self.head(out)


def lstm():
  return RNNHead("lstm"), (torch.randn(2, 5, 6),), "embed"


def gru():
  return RNNHead("gru"), (torch.randn(2, 5, 6),), "embed"


class EncoderStack(nn.Module):
  def __init__(self):
    super().__init__()
    self.embed = nn.Linear(6, 16)
    self.layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, batch_first=True)
    self.head = nn.Linear(16, 3)

  def forward(self, x):
    return self.head(self.layer(self.embed(x)))


def transformer_encoder_layer():
  return EncoderStack(), (torch.randn(2, 5, 6),), "layer.linear1"


class MHABlock(nn.Module):
  def __init__(self):
    super().__init__()
    self.proj = nn.Linear(6, 16)
    self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
    self.out = nn.Linear(16, 3)

  def forward(self, x):
    h = self.proj(x)
    mask = torch.triu(torch.ones(h.shape[1], h.shape[1], dtype=torch.bool), diagonal=1)
    a, _ = self.attn(h, h, h, attn_mask=mask, need_weights=False)
    return self.out(a + h)


def multihead_attention():
  return MHABlock(), (torch.randn(2, 5, 6),), "proj"


def conv_bn_relu():
  model = nn.Sequential(
    nn.Conv1d(3, 8, 3, padding=1),
    nn.BatchNorm1d(8),
    nn.ReLU(),
    nn.Unflatten(1, (8, 1)),
    nn.Conv2d(8, 8, (1, 3), padding=(0, 1)),
    nn.BatchNorm2d(8),
    nn.ReLU(),
    nn.Flatten(1),
    nn.Linear(8 * 12, 4),
  )
  return model, (torch.randn(2, 3, 12),), "2"


class EmbeddingBag(nn.Module):
  def __init__(self):
    super().__init__()
    self.embed = nn.Embedding(23, 8, padding_idx=0)
    self.mix = nn.Linear(8, 8)
    self.head = nn.Linear(8, 5)

  def forward(self, idx):
    return self.head(torch.tanh(self.mix(self.embed(idx))).mean(dim=1))


def embedding():
  return EmbeddingBag(), (torch.randint(0, 23, (3, 6)),), "mix"


class Functional(nn.Module):
  """Functional style: SDPA, einsum, in-place ops and views."""

  def __init__(self):
    super().__init__()
    self.qkv = nn.Linear(8, 24)
    self.mix = nn.Linear(8, 8)
    self.gate = nn.Parameter(torch.randn(8))

  def forward(self, x):
    b, s, _ = x.shape
    q, k, v = self.qkv(x).view(b, s, 3, 2, 4).permute(2, 0, 3, 1, 4).unbind(0)
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    a = a.transpose(1, 2).reshape(b, s, 8)
    h = self.mix(a)
    h = torch.einsum("bsd,d->bsd", h, self.gate)
    h.mul_(0.5).add_(x)
    h[:, 0] = h[:, 0] * 2.0
    return torch.einsum("bsd,bte->bde", h, x)


def functional():
  return Functional(), (torch.randn(2, 5, 8),), "mix"


ZOO: dict[str, Callable] = {
  "gpt2": gpt2,
  "llama": llama,
  "bert": bert,
  "resnet18": resnet18,
  "lstm": lstm,
  "gru": gru,
  "transformer_encoder_layer": transformer_encoder_layer,
  "multihead_attention": multihead_attention,
  "conv_bn_relu": conv_bn_relu,
  "embedding": embedding,
  "functional": functional,
}


def build(name: str, dtype: torch.dtype = torch.float32, seed: int = 0):
  """Builds a zoo model in eval mode with random weights and running statistics.

  Returns ``(model, inputs, site)``; floating inputs and parameters are in ``dtype``.
  """
  torch.manual_seed(seed)
  model, inputs, site = ZOO[name]()
  model = model.to(dtype).eval()
  with torch.no_grad():
    for m in model.modules():  # non-trivial BatchNorm statistics
      if isinstance(m, nn.modules.batchnorm._BatchNorm):
        m.running_mean.copy_(torch.randn_like(m.running_mean) * 0.1)
        m.running_var.copy_(torch.rand_like(m.running_var) + 0.5)
        m.weight.copy_(torch.randn_like(m.weight) * 0.2 + 1.0)
        m.bias.copy_(torch.randn_like(m.bias) * 0.1)
  inputs = tuple(x.to(dtype) if x.is_floating_point() else x for x in inputs)
  return model, inputs, site
