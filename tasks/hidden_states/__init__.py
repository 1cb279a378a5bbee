"""Stage 6: the target model's hidden states for every training sequence.

Two backends write the same output. `transformers` loads the target in this process and hooks its layers. `vllm`
asks an extraction server (vLLM with the `extract_hidden_states` speculative method and a hidden-states KV connector,
see infra/vllm-gpu/) for targets too large for one process: one token-id prompt per sequence with max_tokens=1, and
the server writes the states to a file on a shared path that this process reads, checks, packs and removes.

Layer ids: "input to layer i" (EAGLE reference, vLLM's `eagle_aux_hidden_state_layer_ids`, speculators) equals
transformers' `hidden_states[i]` (0 = embeddings); SpecForge/Model-Optimizer name the same tensor "output of layer
i-1". The index and every part record both. The final state is the last layer's output BEFORE the final norm, for
both backends (vLLM's id N, the input of transformers' `model.norm`): speculators trains on it, and the norm's weight
and eps are kept beside it so the after-norm state SpecForge trains on is exact too (`final_rms_norm`). The reverse
is impossible: the norm discards each token's scale.

Modules: `targets` (what a backend knows of the target, the aux layers), `batching`, `parts` (sequences in,
parts and index out), `transformers_backend`, `vllm_backend`, `task` (the Prefect task). The output format
(parts, final norm and index per shard), which export and verify read too, is described and read in
`eagle3_datagen.hidden_state_format`.
"""

from tasks.hidden_states.task import ExtractionSettings, extract_hidden_states

__all__ = ["ExtractionSettings", "extract_hidden_states"]
