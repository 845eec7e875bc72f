"""Hugging Face ``transformers`` MoE models on flexmoe (docs/architecture.md, "Hugging Face models (flexmoe.hf)").

* :func:`convert` replaces a model's sparse-MoE blocks (Mixtral, Qwen2/3-MoE, Qwen3-Next, OLMoE, DeepSeek-V2/V3,
  GLM-4.5, GPT-OSS, Switch Transformers) with flexmoe blocks computing the same function, optionally spread over an
  expert-parallel group; their state dict is HF's block's (:mod:`flexmoe.hf.hf_state`), so ``save_pretrained``
  and ``Trainer`` write HF's format as they are; :func:`to_hf` turns them back into HF blocks with the trained
  weights.
* :func:`upcycle_into_twin` turns a dense Llama / Mistral / Qwen2 / Qwen3 model's MLPs into its MoE twin's
  converted blocks (Mixtral / Qwen3-MoE) computing the same function at the start.
* :func:`load` builds a ``save_pretrained`` directory's model on the meta device, converts it, lays it on a device
  mesh and reads on each rank only the tensors (and the boxes of them) that rank holds; :func:`save_pretrained`
  writes such a model back in HF's format gathering one block at a time.
* :class:`ExpertParallelTrainer` is ``transformers.Trainer`` with the experts spread over the ranks (``torchrun``):
  DDP beside the experts, collective saves, per-rank optimizer states, strict resume, the global gradient norm.
* :func:`register` adds ``"flexmoe"`` to transformers' experts implementations: HF's own routing, flexmoe's
  dispatch and expert FFN on HF's parameters, no conversion.

Needs ``transformers`` >= 5: ``pip install flexmoe[hf]``. ``import flexmoe`` never imports it.
"""

from __future__ import annotations

try:
    import transformers
except ImportError as error:  # pragma: no cover - exercised without the extra installed
    raise ImportError("flexmoe.hf needs Hugging Face transformers >= 5: pip install flexmoe[hf]") from error
if int(transformers.__version__.split(".")[0]) < 5:
    raise ImportError(f"flexmoe.hf needs transformers >= 5 (fused expert weights), found {transformers.__version__}: "
                      f"pip install flexmoe[hf]")

from flexmoe.hf.block import ConvertedMoeBlock
from flexmoe.hf.convert import convert, to_hf
from flexmoe.hf.experts_impl import flexmoe_experts_forward, register
from flexmoe.hf.export import save_pretrained
from flexmoe.hf.families import FAMILIES
from flexmoe.hf.load import load
from flexmoe.hf.stored import SafetensorsReader
from flexmoe.hf.trainer import ExpertParallelTrainer
from flexmoe.hf.upcycle import upcycle_into_twin

__all__ = ["convert", "to_hf", "load", "save_pretrained", "SafetensorsReader", "register", "flexmoe_experts_forward",
           "ConvertedMoeBlock", "FAMILIES", "upcycle_into_twin", "ExpertParallelTrainer"]
