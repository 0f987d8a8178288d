"""The benchmarks' ways of naming a FusedDecodePolicy: bench_runner's `--fused-policy
field=value,..` and bench_fused_decode's "fused+option" variants. A candidate default runs only
as what the option names; a typo must stop the run, not time the default under its name."""
import pytest

from bench import bench_fused_decode as bfd
from bench import bench_runner
from padgraph.backends.triton.fused_decode import FusedDecodePolicy


def test_fused_policy_fields_parse_to_ints_and_bools():
    fields = bench_runner.parse_policy("tc_qkv_splits=2,attn_pdl=true,tc_fold=False,half_n=4")
    assert fields == {"tc_qkv_splits": 2, "attn_pdl": True, "tc_fold": False, "half_n": 4}
    policy = FusedDecodePolicy(**fields)
    assert policy.tc_qkv_splits == 2 and policy.attn_pdl and not policy.tc_fold
    assert bench_runner.parse_policy("") == {}


@pytest.mark.parametrize("text", ["tc_qkv_split=2", "attn_pdl", "half_n=", "half_n=four"])
def test_a_misnamed_or_malformed_field_stops_the_run(text):
    with pytest.raises((SystemExit, ValueError)):
        bench_runner.parse_policy(text)


def test_variant_options_name_policy_fields():
    p = bfd.policy_of("fused+pdl+apdl+tcqkvs2+tcds4+nofold")
    assert p.pdl and p.tc_pdl and p.attn_pdl and not p.tc_fold
    assert (p.tc_qkv_splits, p.tc_down_splits) == (2, 4)
    assert bfd.policy_of("fused") == FusedDecodePolicy(pdl=False, attn_pdl=False)
    assert bfd.policy_of("fused+apdl").attn_pdl and not bfd.policy_of("fused+apdl").pdl
    with pytest.raises(SystemExit):
        bfd.policy_of("fused+apdll")
