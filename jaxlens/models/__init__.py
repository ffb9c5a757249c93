"""jaxlens's model zoo: readable Flax implementations of GPT-2, the Llama family (with Mistral,
Qwen2 and Qwen3), GPT-NeoX, Gemma 3 and BERT with named sites (``docs/models.md``), their
offline loaders, and the small demo GPT.

One family per module: :mod:`jaxlens.models.gpt2`, :mod:`jaxlens.models.llama`,
:mod:`jaxlens.models.gpt_neox`, :mod:`jaxlens.models.gemma`, :mod:`jaxlens.models.bert`, all
composed of the shared blocks of :mod:`jaxlens.models.blocks` and :mod:`jaxlens.models.rope`;
file formats in :mod:`jaxlens.models.loading`; the pretrained models published as Python wheels
in :mod:`jaxlens.models.hub` (``jm.smollm2()``, ``jm.gemma3()``, ``jm.minilm()``).
"""

from jaxlens.models import compact as compact
from jaxlens.models import demo as demo
from jaxlens.models import scan as scan
from jaxlens.models import hub as hub
from jaxlens.models._demo_gpt import GPT as GPT
from jaxlens.models._demo_gpt import MLP as MLP
from jaxlens.models._demo_gpt import Block as Block
from jaxlens.models._demo_gpt import CausalSelfAttention as CausalSelfAttention
from jaxlens.models._demo_gpt import gpt_config as gpt_config
from jaxlens.models._demo_gpt import init_gpt as init_gpt
from jaxlens.models.bert import Bert as Bert
from jaxlens.models.bert import BertConfig as BertConfig
from jaxlens.models.bert import mean_pool as mean_pool
from jaxlens.models import blocks as blocks
from jaxlens.models import rope as rope
from jaxlens.models.gemma import Gemma3 as Gemma3
from jaxlens.models.gemma import Gemma3Config as Gemma3Config
from jaxlens.models.gpt2 import GPT2 as GPT2
from jaxlens.models.gpt2 import GPT2Config as GPT2Config
from jaxlens.models.gpt_neox import GPTNeoX as GPTNeoX
from jaxlens.models.gpt_neox import GPTNeoXConfig as GPTNeoXConfig
from jaxlens.models.hub import gemma3 as gemma3
from jaxlens.models.hub import minilm as minilm
from jaxlens.models.hub import smollm2 as smollm2
from jaxlens.models.llama import Llama as Llama
from jaxlens.models.llama import LlamaConfig as LlamaConfig
from jaxlens.models.loading import LoadError as LoadError
from jaxlens.models.loading import Pretrained as Pretrained
from jaxlens.models.loading import config_from_hf as config_from_hf
from jaxlens.models.loading import from_state_dict as from_state_dict
from jaxlens.models.loading import load_gguf as load_gguf
from jaxlens.models.loading import load_hf as load_hf
from jaxlens.models.loading import params_from_hf as params_from_hf
from jaxlens.models.loading import tokenizer_from_gguf as tokenizer_from_gguf

__all__ = [
  "GPT",
  "GPT2",
  "MLP",
  "Bert",
  "BertConfig",
  "Block",
  "CausalSelfAttention",
  "GPT2Config",
  "GPTNeoX",
  "GPTNeoXConfig",
  "Gemma3",
  "Gemma3Config",
  "Llama",
  "LlamaConfig",
  "LoadError",
  "Pretrained",
  "blocks",
  "config_from_hf",
  "compact",
  "demo",
  "scan",
  "from_state_dict",
  "gemma3",
  "gpt_config",
  "hub",
  "init_gpt",
  "load_gguf",
  "load_hf",
  "mean_pool",
  "minilm",
  "params_from_hf",
  "rope",
  "smollm2",
  "tokenizer_from_gguf",
]
