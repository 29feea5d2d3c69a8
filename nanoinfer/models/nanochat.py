"""nanochat's GPT (karpathy/nanochat), the current architecture ("era F") and the older eras.

What sets it apart from Llama: every norm is a weightless RMSNorm; the embedding is
"smeared" with the previous token's; each layer mixes the stream with the first
embedding x0 through learned scalars; some layers add a gated value embedding to v;
q and k are normed after rotary and scaled; the MLP is relu squared; half-way activations
are subtracted again at the end ("backout"); logits are soft-capped.

The era decides which of these exist and with which constants; the loader detects it
from the state dict and writes the facts into `config.extra`:
  era, qk_scale, softcap, padded_vocab, ve_layers, ve_gate_channels, ve_gate_scale,
  smear_channels, backout_layer, lambdas (bool).
State-dict keys are nanochat's own, so a checkpoint loads 1:1.

The forward is per token, like LlamaForCausalLM's: one ForwardBatch, a flat run of tokens
(one or several sequences, or chunks of them), their positions, and an attention backend
that separates the sequences. The one cross-token operation outside attention, the smear, gets the
previous token of each position as an id (`prev_ids`), so it needs no state of its own.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from .batch import ForwardBatch
from .rotary import RotaryTable


def norm(x: torch.Tensor) -> torch.Tensor:
    """nanochat's only norm: RMSNorm without a weight, torch's default eps (that of the dtype)."""
    return F.rms_norm(x, (x.shape[-1],))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split layout, rotating by minus theta (nanochat's sign convention, the opposite
    of Llama's). x: [T, heads, head_dim]; cos, sin: [T, 1, head_dim // 2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1)


def previous_ids(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """prev_ids for a run of whole sequences without a cache: the token before each one, -1
    where a sequence starts (position 0). A run that starts mid-sequence cannot know the
    token before it, so the caller must pass prev_ids then."""
    if positions.numel() and int(positions[0]) != 0:
        raise ValueError("prev_ids is needed when the tokens do not start at position 0")
    prev = torch.roll(input_ids, 1)
    return prev.masked_fill(positions == 0, -1)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        extra = config.extra
        self.layer = layer
        self.n_head, self.n_kv_head, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        d = config.hidden_size
        self.c_q = nn.Linear(d, self.n_head * self.head_dim, bias=False)
        self.c_k = nn.Linear(d, self.n_kv_head * self.head_dim, bias=False)
        self.c_v = nn.Linear(d, self.n_kv_head * self.head_dim, bias=False)
        self.c_proj = nn.Linear(self.n_head * self.head_dim, d, bias=False)
        self.qk_scale = float(extra.get("qk_scale", 1.0))
        if layer in extra.get("ve_layers", ()):
            # The gate reads only the first few channels of the normed input: one weight per kv head.
            self.ve_gate_channels = int(extra["ve_gate_channels"])
            self.ve_gate_scale = float(extra["ve_gate_scale"])
            self.ve_gate = nn.Linear(self.ve_gate_channels, self.n_kv_head, bias=False)
        else:
            self.ve_gate = None

    def forward(self, x: torch.Tensor, ve: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        T = x.shape[0]
        q = self.c_q(x).view(T, self.n_head, self.head_dim)
        k = self.c_k(x).view(T, self.n_kv_head, self.head_dim)
        v = self.c_v(x).view(T, self.n_kv_head, self.head_dim)
        if ve is not None:
            gate = self.ve_gate_scale * torch.sigmoid(self.ve_gate(x[:, :self.ve_gate_channels]))  # [T, kv heads]
            v = v + gate.unsqueeze(-1) * ve.view(T, self.n_kv_head, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # Normed after rotary; the scale sharpens attention without touching softmax's 1/sqrt(d).
        q, k = norm(q), norm(k)
        if self.qk_scale != 1.0:
            q, k = q * self.qk_scale, k * self.qk_scale
        out = batch.attend(self.layer, q, k, v)
        return self.c_proj(out.reshape(T, self.n_head * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.c_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.relu(self.c_fc(x)).square())


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.attn = CausalSelfAttention(config, layer)
        self.mlp = MLP(config)

    def forward(self, x, ve, cos, sin, batch: ForwardBatch):
        x = x + self.attn(norm(x), ve, cos, sin, batch)
        return x + self.mlp(norm(x))


class NanochatGPT(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        extra = config.extra
        self.era: str = extra.get("era", "F")
        self.vocab_size = config.vocab_size
        padded = int(extra.get("padded_vocab", -(-config.vocab_size // 64) * 64))
        d, n_layer = config.hidden_size, config.num_layers
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(padded, d, _weight=torch.empty(padded, d)),  # no init: see llama.Backbone
            "h": nn.ModuleList(Block(config, i) for i in range(n_layer)),
        })
        self.lm_head = nn.Linear(d, padded, bias=False)  # not tied to wte
        softcap = extra.get("softcap", 15.0)
        self.softcap = float(softcap) if softcap else None

        # The learned scalars stay fp32 whatever the served dtype (nanochat keeps them fp32
        # too). They are persistent buffers, not parameters, so that the model's parameters
        # all share the served dtype (the engine sizes its KV cache from the first one).
        if extra.get("lambdas", True):
            self.register_buffer("resid_lambdas", torch.ones(n_layer))
            self.register_buffer("x0_lambdas", torch.zeros(n_layer))
        else:  # era A: the stream is not mixed with x0
            self.resid_lambdas = self.x0_lambdas = None
        ve_layers = sorted(extra.get("ve_layers", ()))
        kv_dim = config.num_kv_heads * config.head_dim
        self.value_embeds = nn.ModuleDict({str(i): nn.Embedding(padded, kv_dim, _weight=torch.empty(padded, kv_dim))
                                           for i in ve_layers}) if ve_layers else None
        if extra.get("smear_channels"):
            self.smear_channels = int(extra["smear_channels"])
            self.smear_gate = nn.Linear(self.smear_channels, 1, bias=False)
            self.register_buffer("smear_lambda", torch.zeros(1))
        else:
            self.smear_gate = None
        self.backout_layer: int | None = extra.get("backout_layer")
        if self.backout_layer is not None:
            self.register_buffer("backout_lambda", torch.zeros(1))
        # The runner computes prev_ids only for models that ask; only the smear needs them.
        self.needs_prev_ids = self.smear_gate is not None

        self.rotary = RotaryTable(self._inv_freq("cpu"), config.max_position_embeddings)
        self.reset_rope()

    def _inv_freq(self, device) -> torch.Tensor:
        dim = self.config.head_dim
        return 1.0 / (self.config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))

    def reset_rope(self) -> None:
        """Empty fp32 rotary tables on the model's device; they grow with the positions served,
        up to max_position_embeddings (nanochat's own table covers 10x sequence_len; the loader
        bounds ours by that). Call again after moving the model."""
        device = self.lm_head.weight.device
        self.rotary.reset(self._inv_freq(device), device)

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Take the tensors as they are (no copy): the model may have been built on the meta
        device. Keys are nanochat's, already normalised by the loader; every tensor the era's
        layout expects must be there with its shape, and nothing else."""
        era = self.config.extra.get("era")
        expected = {k: v.shape for k, v in self.state_dict().items()}
        for key, shape in expected.items():
            if key not in state:
                raise ValueError(f"unknown tensor layout for era {era}: {key} is missing")
            if state[key].shape != shape:
                raise ValueError(f"unknown tensor layout: {key} has shape {list(state[key].shape)}, "
                                 f"expected {list(shape)}")
        extra = sorted(set(state) - set(expected))
        if extra:
            raise ValueError(f"unknown tensor layout for era {era}: unexpected {', '.join(extra[:4])}")
        self.load_state_dict(state, strict=True, assign=True)

    def _smear(self, x: torch.Tensor, prev_ids: torch.Tensor) -> torch.Tensor:
        """x_t += gate_t * x_{t-1}: a cheap bigram feature. x_{t-1} (the previous token's normed
        embedding) is recomputed from its id, so prefill chunks and decode steps need no saved
        activations; a sequence's first token (prev -1) has nothing to mix in."""
        gate = self.smear_lambda * torch.sigmoid(self.smear_gate(x[:, :self.smear_channels]))  # [T, 1]
        x_prev = norm(self.transformer.wte(prev_ids.clamp(min=0)))
        smeared = (x + gate * x_prev).to(x.dtype)
        return torch.where((prev_ids >= 0).unsqueeze(1), smeared, x)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """batch.prev_ids: each token's predecessor in its own sequence, -1 at position 0;
        derived from input_ids when None and the run is whole sequences. Returns fp32
        soft-capped logits [rows, vocab_size] for batch.logits_indices (all rows when None)."""
        return self.compute_logits(self.hidden_states(batch))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)[:, :self.vocab_size].float()  # drop the padding rows
        if self.softcap is not None:
            logits = self.softcap * torch.tanh(logits / self.softcap)
        return logits

    def hidden_states(self, batch: ForwardBatch) -> torch.Tensor:
        """The final normalised hidden states of the rows in batch.logits_indices."""
        batch = batch.resolved(self.config)
        input_ids, positions, prev_ids = batch.input_ids, batch.positions, batch.prev_ids
        x = norm(self.transformer.wte(input_ids))
        dtype = x.dtype
        if self.smear_gate is not None:
            x = self._smear(x, previous_ids(input_ids, positions) if prev_ids is None else prev_ids)
        x0 = x
        cos, sin = self.rotary(positions, dtype)
        x_backout = None
        for i, block in enumerate(self.transformer.h):
            if self.resid_lambdas is not None:
                x = (self.resid_lambdas[i] * x + self.x0_lambdas[i] * x0).to(dtype)
            key = str(i)
            ve = self.value_embeds[key](input_ids) if self.value_embeds is not None and key in self.value_embeds else None
            x = block(x, ve, cos, sin, batch)
            if i == self.backout_layer:
                x_backout = x
        if batch.logits_indices is not None:
            x = x[batch.logits_indices]
            x_backout = x_backout[batch.logits_indices] if x_backout is not None else None
        if x_backout is not None:
            # Take back part of the mid-network state: it helped the middle layers, not the head.
            x = (x - self.backout_lambda * x_backout).to(dtype)
        return norm(x)
