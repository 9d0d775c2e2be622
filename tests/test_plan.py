import pytest

from parsim.codec import validate_plan
from parsim.errors import ParsimError
from parsim.flags import plan_from_given
from parsim.plan import Plan, plan_from_flags, ranks_per_node
from parsim.spec import PRESETS


def test_plan_id_stable_and_json_roundtrip():
    p = Plan(dp_shard=8, tp=8, seq_len=4096, local_batch_size=4, ac="full")
    q = Plan.from_dict(p.to_dict())
    assert p == q and p.plan_id == q.plan_id
    assert p.plan_id == Plan(tp=8, dp_shard=8, seq_len=4096, local_batch_size=4, ac="full").plan_id
    assert p.plan_id != Plan(dp_shard=8, tp=8, seq_len=4096, local_batch_size=4, ac="selective-op").plan_id


def test_dp_shard_rest_and_world_size():
    assert plan_from_flags(64, tp=8).dp_shard == 8
    with pytest.raises(ParsimError, match=r"64 GPUs are not divisible by .* = 3"):
        plan_from_flags(64, tp=3)
    with pytest.raises(ParsimError, match=r"= 32, not the 64 GPUs"):
        plan_from_flags(64, dp_shard=4, tp=8)


@pytest.mark.parametrize("kw,msg", [
    (dict(tp=3, dp_shard=1, seq_len=3072), "n_heads 32 is not divisible by tp 3"),
    (dict(pp=64, micro_batch_size=1, local_batch_size=64), "32 layers cannot fill"),
    (dict(ep=2, dp_shard=2), "is dense"),
])
def test_validate_for_model(kw, msg):
    with pytest.raises(ParsimError, match=msg):
        validate_plan(Plan(**kw), PRESETS["llama3-8b"])


@pytest.mark.parametrize("kw,msg", [
    (dict(pp=4, local_batch_size=2, micro_batch_size=1), r"needs at least pp=4 microbatches"),
    (dict(pp=2, pp_schedule="Interleaved1F1B", pp_stages_per_rank=1, local_batch_size=2, micro_batch_size=1),
     "pp_stages_per_rank >= 2"),
    (dict(dp_shard=2, global_batch_size=3), r"global batch 3 is not a multiple of local batch x dp = 1 x 2 = 2"),
    (dict(cp=4, seq_len=100), r"divisible by 2 x cp = 8"),
    (dict(dp_shard=4, ep=3), r"dp_shard x cp x tp = 4 x 1 x 1 = 4 divisible by ep x etp = 3 x 1 = 3"),
    (dict(ac="sometimes"), "bad AC mode"),
    (dict(mesh_order=("tp", "pp")), "permutation"),
])
def test_plan_invariants(kw, msg):
    """Field values are checked when a Plan is built; its structure (batch splits, divisibility, schedules) by the
    one rule table at the boundary (``codec.validate_plan``: flags, files, predict, run)."""
    with pytest.raises(ParsimError, match=msg):
        validate_plan(Plan(**kw))


def test_a_plan_is_a_plain_value_until_validated():
    p = Plan(pp=4, local_batch_size=2, micro_batch_size=1)  # breaks a structural rule: built all the same
    assert p.pp == 4
    with pytest.raises(ParsimError, match="needs at least pp=4 microbatches"):
        validate_plan(p)
    with pytest.raises(ParsimError, match="needs at least pp=4 microbatches"):  # flags: checked where built
        plan_from_given({"gpus": 4, "pp": 4, "dp_shard": 1, "local_batch_size": 2, "micro_batch_size": 1})


def test_ranks_per_node_follows_device_order():
    deg = {"pp": 1, "dp_replicate": 4, "dp_shard": 8, "cp": 1, "tp": 8}
    order = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    assert ranks_per_node(deg, order, 8, ("tp",)) == 8
    assert ranks_per_node(deg, order, 8, ("dp_shard",)) == 1
    inner_dp = ("pp", "dp_replicate", "tp", "cp", "dp_shard")
    assert ranks_per_node(deg, inner_dp, 8, ("dp_shard",)) == 8
    assert ranks_per_node(deg, inner_dp, 8, ("tp",)) == 1
    assert ranks_per_node(deg, order, 16, ("dp_shard", "cp")) == 2


def test_moe_ep_plan():
    p = Plan(dp_shard=8, ep=4, seq_len=4096)
    validate_plan(p, PRESETS["mixtral-8x7b"])
    assert p.efsdp == 2
    with pytest.raises(ParsimError, match="do not divide over ep"):
        validate_plan(Plan(dp_shard=16, ep=16), PRESETS["mixtral-8x7b"])
