"""RunStats on the CPU (reference backend, tiny model): what the rounds emitted against what
verify accepted."""
import torch

import padgraph as pg
from padgraph.llm import Engine, SpecConfig
from padgraph.llm.models import EagleHead, LlamaConfig, LlamaModel


def test_tokens_per_round_counts_what_rounds_emitted():
    """accept_len is verify's count; tokens_per_round what the requests gained (budgets cut the
    last round): every emitted token but the prefill's first one per request."""
    torch.manual_seed(0)
    target = LlamaModel(LlamaConfig.tiny(n_layers=1)).eval()
    head = EagleHead.copy_of_target(target).eval()
    w = Engine(target, head, SpecConfig(steps=3, topk=2, num_draft_tokens=5), max_bs=4,
               max_context=64, buckets=pg.Buckets([1, 2, 4]))
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, target.cfg.vocab_size, (n,), generator=g).tolist()
               for n in (7, 12, 4)]
    with torch.no_grad():
        reqs, st = w.generate_spec(prompts, [5, 9, 2])
    assert st.emitted == sum(len(r.output) for r in reqs) - len(reqs)
    assert st.emitted <= st.accepted
    assert st.tokens_per_round <= st.accept_len
