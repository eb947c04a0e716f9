"""The EAGLE3(.1) MLA draft (checkpoint/draft.py's MLA layout) as an NxDI draft model for NxDI's fused speculation
(NXDI_CONTRACT.md: eagle3-mla-draft): NxDI's NeuronBaseModel drives it as it drives its Llama EAGLE3 draft (the
embedding and the fused hidden state concatenated by process_eagle_draft_hidden_states, the pre-norm feedback in
full_hidden_states, lm_head over the normed output), with the core's EAGLE3 layer (model/eagle3.py: the core's MLA,
absorbed in decode) as its one decoder layer in the target's NxDI form (base.KimiK2DecoderLayer: the latent entry
in the K slot of its own cache, V one wide, NxDI's latent cache manager), EAGLE3.1's fc_norm before fc and its
norm_output in the feedback, and a reduced vocabulary mapped in the graph (draft_vocab.py). Its config is
draft_config.Eagle3MlaInferenceConfig."""

from __future__ import annotations

from .sdk import require_neuron_sdk

require_neuron_sdk()

import torch  # noqa: E402
from neuronx_distributed.parallel_layers.layers import ColumnParallelLinear, ParallelEmbedding  # noqa: E402
from neuronx_distributed_inference.models.model_base import NeuronBaseForCausalLM, NeuronBaseModel  # noqa: E402
from neuronx_distributed_inference.modules.generation.sampling import create_sampler  # noqa: E402
from neuronx_distributed_inference.utils.distributed import get_tp_group  # noqa: E402
from torch import nn  # noqa: E402

from kimi_k2_neuron.checkpoint.draft import AUX_INPUTS  # noqa: E402
from kimi_k2_neuron.model.eagle3 import Eagle3Layer, draft_outputs, fc_norms, fuse_aux  # noqa: E402
from kimi_k2_neuron.model.norm import RMSNorm  # noqa: E402
from kimi_k2_neuron.model.rope import RotaryTable  # noqa: E402
from kimi_k2_neuron.placement import Layout  # noqa: E402

from .draft_vocab import DraftVocabMap, draft_lm_head  # noqa: E402
from .base import DECODE, PREFILL, KimiK2DecoderLayer, NxDParallelContext, set_model_attrs  # noqa: E402
from .draft_config import Eagle3MlaInferenceConfig  # noqa: E402
from .latent_cache import LatentKVCacheManager  # noqa: E402

ARCHITECTURE = "Eagle3DeepseekV2ForCausalLM"


class Eagle3MlaDecoderLayer(Eagle3Layer, KimiK2DecoderLayer):
    """The core's EAGLE3 layer answering NxDI's decoder-layer contract as the target's layers do."""


class Eagle3MlaDraftModel(DraftVocabMap, NeuronBaseModel):
    def setup_attr_for_model(self, config: Eagle3MlaInferenceConfig):
        set_model_attrs(self, config)

    def init_model(self, config: Eagle3MlaInferenceConfig):
        cfg, nc = config.core_config(), config.neuron_config
        dtype, h = nc.torch_dtype, config.hidden_size
        gather = not self.on_device_sampling or nc.on_cpu  # as the target's (NXDI_CONTRACT.md: cpu-sampler)
        ctx = NxDParallelContext(tp_size=nc.tp_degree, layout=Layout(), gather_logits=gather,
                                 reduce_dtype=nc.rpl_reduce_dtype, config=config, rank_util=self.rank_util)
        group = get_tp_group(config)  # NxDI's draft group for the embedding and lm_head (NXDI_CONTRACT.md: draft-tp)
        self.embed_tokens = ParallelEmbedding(config.vocab_size, h, dtype=dtype, shard_across_embedding=True,
                                              tensor_model_parallel_group=group)
        # the draft's CTE submodel is a prefill (NxDI sets is_prefill_stage on its config there); its fused step
        # decodes, on its own cache, never sequence-sharded
        attention = PREFILL if nc.is_prefill_stage else DECODE
        self.layers = nn.ModuleList([Eagle3MlaDecoderLayer(cfg, dtype, ctx, rotary=RotaryTable(cfg),
                                                           attention=attention)])
        self.fc = ColumnParallelLinear(AUX_INPUTS * h, h, bias=False, gather_output=True, dtype=dtype)
        self.fc_norm = fc_norms(h, cfg.rms_norm_eps, dtype) if getattr(config, "fc_norm", False) else None
        self.norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.lm_head = draft_lm_head(config, gather)
        self.norm_output = bool(getattr(config, "norm_output", False))
        self.init_vocab_map(config)

    def init_inference_optimization(self, config: Eagle3MlaInferenceConfig):
        if self.on_device_sampling:
            self.sampler = create_sampler(config.neuron_config, self.lm_head.tensor_parallel_group.size())
        self.kv_mgr = LatentKVCacheManager(config, num_kv_head=1, global_rank=self.rank_util)

    def _process_eagle3_hidden_states(self, hidden_states, prev_hidden, weight_gather):
        """NxDI's, with fc_norm: the target's captured 3H through fc (each H first normed under fc_norm); the draft's
        own H-wide feedback as it is."""
        if prev_hidden.shape[2] == AUX_INPUTS * hidden_states.shape[2]:
            prev_hidden = fuse_aux(prev_hidden, self.fc, self.fc_norm)
        return torch.cat((hidden_states, prev_hidden.to(hidden_states.dtype)), dim=2)

    def get_model_output(self, *args, **kwargs):
        """EAGLE3.1's norm_output: the next draft step reads the normed hidden state."""
        out = super().get_model_output(*args, **kwargs)
        if self.full_hidden_states is not None:
            self.full_hidden_states = draft_outputs(self.norm, self.full_hidden_states, self.norm_output)[1]
        return out


class Eagle3MlaDraftForCausalLM(NeuronBaseForCausalLM):
    """The draft_model_cls: NxDI builds the draft from _model_cls and reloads its config with get_config_cls();
    its weights come from fused_spec.state_dict."""

    _model_cls = Eagle3MlaDraftModel

    @classmethod
    def get_config_cls(cls):
        return Eagle3MlaInferenceConfig


def neuron_state_dict(tensors: dict, tp_degree: int) -> dict:
    """checkpoint/draft.py's neuron_tensors are this model's names already; NxDI's rank table beside them."""
    return {**tensors, "rank_util.rank": torch.arange(tp_degree, dtype=torch.int32)}
