"""How a `Decoder.generate` call decodes, resolved as Hugging Face's `generate` resolves it.

HF's precedence: the call's keywords over the `generation_config` given over the model's own
`model.generation_config` over HF's global defaults (`GenerationMixin._prepare_generation_config`
does the merge here, so the defaults are HF's own). The result is one `Plan`: the
`padgraph.llm.sampling.SamplingParams` every row draws with (HF's processor order: temperature,
top-k, top-p, min-p; `do_sample=False` is temperature 0, greedy), the number of new tokens, the
tokens that end a row and the pad written after them.

A configuration HF would decode with a processor padgraph does not apply (repetition penalty,
beams, typical-p, ...) is refused (`ArgumentError` naming the field), never decoded otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from padgraph.llm.requests import request_seed
from padgraph.llm.sampling import SEED_MAX, SamplingParams

from . import arguments

WHERE = "padgraph.hf.Decoder.generate"

# field -> the values with which HF's generate applies no processor / strategy of that field
OFF = {
    "num_beams": (None, 1), "num_beam_groups": (None, 1), "num_return_sequences": (None, 1),
    "penalty_alpha": (None,), "dola_layers": (None,), "repetition_penalty": (None, 1.0),
    "encoder_repetition_penalty": (None, 1.0), "no_repeat_ngram_size": (None, 0),
    "encoder_no_repeat_ngram_size": (None, 0), "bad_words_ids": (None,), "force_words_ids": (None,),
    "sequence_bias": (None,), "suppress_tokens": (None,),
    "begin_suppress_tokens": (None,), "forced_bos_token_id": (None,), "forced_eos_token_id": (None,),
    "exponential_decay_length_penalty": (None,), "guidance_scale": (None, 1.0), "typical_p": (None, 1.0),
    "epsilon_cutoff": (None, 0.0), "eta_cutoff": (None, 0.0), "top_h": (None,), "watermarking_config": (None,),
    "stop_strings": (None,), "max_time": (None,), "return_dict_in_generate": (None, False),
    "prompt_lookup_num_tokens": (None,), "assistant_early_exit": (None,),
    "assistant_ensemble_weight": (None,), "speculation_type": (None,), "constraints": (None,),
    "token_healing": (None, False),
}


@dataclass(frozen=True)
class Plan:
    """One generate call: every row's sampling parameters, new tokens, end tokens and pad."""
    params: SamplingParams
    max_new_tokens: int
    eos: tuple[int, ...]
    pad: int | None


def resolve(model, prompt_len: int, generation_config=None, **keywords) -> Plan:
    """The call's `Plan`; keywords are HF's generate keywords (do_sample, temperature, top_k, top_p,
    min_p, max_new_tokens, eos_token_id, pad_token_id), None meaning not given."""
    from transformers import GenerationConfig
    if generation_config is not None and not isinstance(generation_config, GenerationConfig):
        arguments.fail(WHERE, "generation_config", generation_config, "None or a transformers.GenerationConfig",
                       arguments.ArgumentTypeError)
    given = {k: v for k, v in keywords.items() if v is not None}
    # HF's has_default_max_length (the call's keywords here take no max_length)
    default_length = ((generation_config is None or generation_config.max_length is None)
                      and model.generation_config.max_length is None)
    try:
        cfg, _ = model._prepare_generation_config(generation_config, **given)   # HF's own merge
    except ValueError as e:
        raise arguments.ArgumentError(f"{WHERE}: {e}") from e
    eos = end_tokens(cfg.eos_token_id)
    refuse_unapplied(cfg, prompt_len, eos)
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else (eos[0] if eos else None)
    limit = getattr(model.config, "max_position_embeddings", None) if default_length else None
    return Plan(sampling_params(cfg), new_tokens(cfg, prompt_len, default_length, limit), eos, pad)


def refuse_unapplied(cfg, prompt_len: int, eos: tuple[int, ...]) -> None:
    """ArgumentError for a field whose HF processor or strategy padgraph does not apply. (The
    minimum lengths only suppress end tokens, so they matter only where there are some.)"""
    for name, off in OFF.items():
        value = getattr(cfg, name, None)
        if not any(value is o or value == o for o in off):
            arguments.fail(WHERE, f"generation_config.{name}", value,
                           f"{' or '.join(map(repr, off))} (padgraph.hf applies temperature, top_k, top_p and "
                           f"min_p only)")
    if eos and (cfg.min_length or 0) > prompt_len:
        arguments.fail(WHERE, "generation_config.min_length", cfg.min_length,
                       f"<= the prompt length {prompt_len} (padgraph.hf does not suppress end tokens)")
    if eos and (cfg.min_new_tokens or 0) > 0:
        arguments.fail(WHERE, "generation_config.min_new_tokens", cfg.min_new_tokens,
                       "None or 0 (padgraph.hf does not suppress end tokens)")


def sampling_params(cfg) -> SamplingParams:
    """HF's warpers as one SamplingParams: temperature (<= 0 refused, as HF's warper refuses it),
    top-k (0: off), top-p (1: off; 0: the top token), min-p (None: off); do_sample False: greedy."""
    if not cfg.do_sample:
        return SamplingParams()
    t = 1.0 if cfg.temperature is None else cfg.temperature
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
        arguments.fail(WHERE, "temperature", t, "a number > 0 with do_sample=True (do_sample=False is greedy)")
    fields = dict(temperature=float(t), top_k=cfg.top_k or 0, top_p=1.0 if cfg.top_p is None else cfg.top_p,
                  min_p=cfg.min_p or 0.0)
    if fields["top_p"] == 0:        # HF keeps its min_tokens_to_keep (1): the top token, ties as top-k's
        fields.update(top_p=1.0, top_k=1)
    try:
        return SamplingParams(**fields)
    except (TypeError, ValueError) as e:
        raise arguments.ArgumentError(f"{WHERE}: {e}") from e


def new_tokens(cfg, prompt_len: int, default_length: bool = False, limit: int | None = None) -> int:
    """HF's rule: max_new_tokens, else max_length minus the (padded) prompt length, where a
    max_length nobody set (`default_length`: not the call, the generation_config given or the
    model's own) counts from the prompt's end, capped at `limit` (the model's
    max_position_embeddings), as `GenerationMixin._prepare_generated_length` does."""
    if cfg.max_new_tokens is not None:
        return arguments.integer(WHERE, "max_new_tokens", cfg.max_new_tokens, 1)
    max_length = cfg.max_length
    if default_length:
        max_length = max_length + prompt_len
        if limit is not None:
            max_length = min(max_length, limit)
    n = max_length - prompt_len
    if n < 1:
        arguments.fail(WHERE, "max_length", cfg.max_length, f"> the prompt length {prompt_len} (or give max_new_tokens)")
    return n


def inferred_mask(input_ids: torch.Tensor, plan: Plan) -> torch.Tensor:
    """The attention mask HF's generate makes when none is given
    (`GenerationMixin._prepare_attention_mask_for_generation`): where the pad token (the
    pad_token_id, else the first end token) occurs in input_ids and is no end token, the
    positions holding another token; else all ones."""
    pad = plan.pad
    if pad is not None and pad not in plan.eos and bool((input_ids == pad).any()):
        return (input_ids != pad).long()
    return torch.ones_like(input_ids)


def end_tokens(eos) -> tuple[int, ...]:
    if eos is None:
        return ()
    ids = [eos] if isinstance(eos, int) else list(eos.tolist() if isinstance(eos, torch.Tensor) else eos)
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
        arguments.fail(WHERE, "eos_token_id", eos, "None, a token id or a list of them")
    return tuple(ids)


def check_stream(seed, generator) -> None:
    """At most one of seed (an int in [0, 2**63 - 1]) and generator (a torch.Generator)."""
    if seed is not None and generator is not None:
        arguments.fail(WHERE, "seed / generator", (seed, generator), "at most one of them")
    if seed is not None:
        arguments.integer(WHERE, "seed", seed, 0)
        if seed > SEED_MAX:
            arguments.fail(WHERE, "seed", seed, "an int in [0, 2**63 - 1]")
    elif generator is not None and not isinstance(generator, torch.Generator):
        arguments.fail(WHERE, "generator", generator, "None or a torch.Generator", arguments.ArgumentTypeError)


def row_seeds(n: int, seed=None, generator=None, device=None) -> torch.Tensor:
    """n seeds [n] int64 on `device`, one random stream per row: row i's is a splitmix64 mix of
    a base seed and i (`padgraph.llm.requests.request_seed`), so a row's stream depends on its
    index and the base only, not on the batch size. The base is `seed` (an int), else one draw
    from `generator` (a torch.Generator), else from torch's global generator (as HF's sampling
    draws from it: `torch.manual_seed` makes a call reproducible)."""
    check_stream(seed, generator)
    if seed is None:
        where = generator.device if generator is not None else torch.device("cpu")
        seed = int(torch.randint(0, SEED_MAX, (), generator=generator, device=where))
    return torch.tensor([request_seed(seed, i) for i in range(n)], dtype=torch.int64).to(device)


def finish_at_end(new: torch.Tensor, eos: tuple[int, ...], pad: int | None) -> torch.Tensor:
    """HF's stopping: after a row's end token, pad tokens; output ends at the step by which every
    row has finished. new [n, T] -> [n, T'] (T' <= T)."""
    if not eos:
        return new
    is_eos = torch.isin(new, torch.as_tensor(eos, device=new.device))                 # [n, T]
    ended = is_eos.long().cumsum(1)                                                    # [n, T]
    new = torch.where(ended - is_eos.long() > 0, pad, new)
    done = (ended > 0).all(0).nonzero()                                                # steps where all rows ended
    return new if done.numel() == 0 else new[:, :int(done[0]) + 1]
