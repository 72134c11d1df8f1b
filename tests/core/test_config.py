"""DiLoCoConfig validation: every error and warning names its knob."""

import warnings

import pytest

import diloco_eqx as dl

ERRORS = [
    (dict(num_replicas=0), r"num_replicas \(K\) must be an integer >= 1; got 0"),
    (dict(num_replicas=2.0), r"num_replicas \(K\)"),
    (dict(sync_period=0), r"sync_period \(H\) must be an integer >= 1"),
    (dict(streaming=True, num_fragments=1), r"num_fragments \(P\) with streaming=True must be an integer >= 2"),
    (dict(alpha=1.5, streaming=True), r"alpha \(α\) must be a number in \[0, 1\]; got 1.5"),
    (dict(alpha=-0.1, streaming=True), r"alpha \(α\) must be a number in \[0, 1\]"),
    (dict(overlap_steps=-1, streaming=True), r"overlap_steps \(V\) must be an integer >= 0"),
    (dict(streaming=True, sync_period=12, num_fragments=4, overlap_steps=12),
     r"overlap_steps \(V\) must be in \[0, H_eff\) = \[0, 12\)"),
    (dict(outer_lr=0.0), r"outer_lr \(η_outer\) must be a number in \(0, inf\); got 0.0"),
    (dict(outer_lr=-1.0), r"outer_lr \(η_outer\)"),
    (dict(outer_momentum=1.0), r"outer_momentum \(β\) must be a number in \[0, 1\); got 1.0"),
    (dict(outer_momentum=-0.5), r"outer_momentum \(β\)"),
    (dict(streaming=True, fragment_order="zigzag"), r"fragment_order must be one of \('interleaved', 'sequential'.*got 'zigzag'"),
    (dict(streaming="yes"), r"streaming must be True or False"),
    (dict(error_decay=1.5, error_feedback=True, compression="topk"), r"error_decay must be a number in \[0, 1\]; got 1.5"),
    (dict(error_decay=-0.1, error_feedback=True, compression="topk"), r"error_decay must be a number in \[0, 1\]"),
    (dict(topk_density=0.0), r"topk_density must be a number in \(0, 1\]; got 0.0"),
    (dict(topk_density=1.5), r"topk_density must be a number in \(0, 1\]"),
    (dict(topk_chunk=0), r"topk_chunk must be an integer in 1..65536 .*; got 0"),
    (dict(topk_chunk=65537), r"topk_chunk must be an integer in 1..65536 .*; got 65537"),
    (dict(topk_chunk=64.0), r"topk_chunk must be an integer"),
    (dict(topk_bits=3), r"topk_bits must be one of \(1, 2, 4, 8\); got 3"),
    (dict(topk_bits=True), r"topk_bits must be one of \(1, 2, 4, 8\); got True"),
]


@pytest.mark.parametrize("kwargs,match", ERRORS)
def test_errors_name_the_knob(kwargs, match):
    with pytest.raises(ValueError, match=match):
        dl.DiLoCoConfig(**kwargs)


def test_h_not_multiple_of_p_warns_with_both_periods():
    with pytest.warns(UserWarning, match=r"sync_period \(H\)=100 .*num_fragments \(P\)=37.*H_eff=111, not 100"):
        dl.DiLoCoConfig(streaming=True, sync_period=100, num_fragments=37)


@pytest.mark.parametrize("kwargs", [dict(overlap_steps=2), dict(alpha=0.5)])
def test_v_or_alpha_without_streaming_warns(kwargs):
    with pytest.warns(UserWarning, match=r"overlap_steps \(V\).*alpha \(α\).*no effect with streaming=False"):
        cfg = dl.DiLoCoConfig(**kwargs)
    assert dl.Schedule.from_config(cfg).overlap_steps == 0


def test_error_decay_without_error_feedback_warns():
    with pytest.warns(UserWarning, match=r"error_decay=0.9 has no effect with error_feedback=False"):
        dl.DiLoCoConfig(compression="topk", error_decay=0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dl.DiLoCoConfig(compression="topk", error_feedback=True, error_decay=0.9)


def test_defaults_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dl.DiLoCoConfig()
        dl.DiLoCoConfig(streaming=True, sync_period=12, num_fragments=4, overlap_steps=1, alpha=0.5)


def test_from_maxtext():
    cfg = dl.DiLoCoConfig.from_maxtext({
        "num_diloco_replicas": 4, "diloco_sync_period": 12, "num_diloco_fragments": 4,
        "enable_streaming_diloco": True, "use_sequential_layers": True,
        "num_communication_overlapping_steps": 1, "communication_overlapping_alpha": 0.5,
        "diloco_outer_lr": 0.5, "diloco_outer_momentum": 0.8, "base_emb_dim": 512,
    })
    assert cfg == dl.DiLoCoConfig(num_replicas=4, sync_period=12, num_fragments=4, streaming=True,
                                  fragment_order="sequential", overlap_steps=1, alpha=0.5,
                                  outer_lr=0.5, outer_momentum=0.8)
    with pytest.raises(ValueError, match=r"outer_momentum \(β\)"):
        dl.DiLoCoConfig.from_maxtext({"diloco_outer_momentum": 1.2})


def test_from_maxtext_derives_k_from_the_diloco_parallelism():
    """MaxText has no num_diloco_replicas knob: K = ici × dcn diloco parallelism."""
    assert dl.DiLoCoConfig.from_maxtext({"dcn_diloco_parallelism": 4}).num_replicas == 4
    assert dl.DiLoCoConfig.from_maxtext(
        {"ici_diloco_parallelism": 2, "dcn_diloco_parallelism": 4}).num_replicas == 8
    # -1: the slices the other DCN axes leave (8 slices / dcn_fsdp 2 = 4)
    cfg = dl.DiLoCoConfig.from_maxtext({"dcn_diloco_parallelism": -1, "num_slices": 8,
                                        "dcn_fsdp_parallelism": 2, "dcn_data_parallelism": -1})
    assert cfg.num_replicas == 4
    with pytest.raises(ValueError, match="dcn_diloco_parallelism=-1 takes its size from num_slices"):
        dl.DiLoCoConfig.from_maxtext({"dcn_diloco_parallelism": -1})
    with pytest.raises(ValueError, match=r"num_slices=6 must be divisible by .* \(4\)"):
        dl.DiLoCoConfig.from_maxtext({"dcn_diloco_parallelism": -1, "num_slices": 6,
                                      "dcn_fsdp_parallelism": 4})
    with pytest.raises(ValueError, match=r"num_diloco_replicas=3 disagrees with .* = 1 × 4 = 4"):
        dl.DiLoCoConfig.from_maxtext({"num_diloco_replicas": 3, "dcn_diloco_parallelism": 4})


def test_from_maxtext_takes_maxtexts_defaults():
    """Missing keys take MaxText's base-config values, not ours: H=36, η=0.3, β=0.9, K=1."""
    cfg = dl.DiLoCoConfig.from_maxtext({})
    assert (cfg.num_replicas, cfg.sync_period, cfg.outer_lr, cfg.outer_momentum) == (1, 36, 0.3, 0.9)
    assert not cfg.streaming and cfg.fragment_order == "interleaved"
    cfg = dl.DiLoCoConfig.from_maxtext({"enable_streaming_diloco": True, "num_diloco_fragments": 4,
                                        "dcn_diloco_parallelism": 2})
    assert (cfg.streaming, cfg.num_fragments, cfg.overlap_steps, cfg.alpha) == (True, 4, 0, 0.0)
    assert dl.Schedule.from_config(cfg).steps_between_syncs == 9  # round(36 / 4)
    with pytest.raises(ValueError, match="needs num_diloco_fragments"):
        dl.DiLoCoConfig.from_maxtext({"enable_streaming_diloco": True})


def test_from_maxtext_warns_on_diloco_keys_it_does_not_model():
    with pytest.warns(UserWarning, match="ignoring DiLoCo-related keys .*: diloco_bucketize_non_scanned, "
                                         "enable_threaded_diloco"):
        cfg = dl.DiLoCoConfig.from_maxtext({"enable_threaded_diloco": True, "dcn_diloco_parallelism": 2,
                                            "diloco_bucketize_non_scanned": True, "base_emb_dim": 512})
    assert cfg.num_replicas == 2
    with pytest.warns(UserWarning, match="enable_diloco=False"):
        dl.DiLoCoConfig.from_maxtext({"enable_diloco": False})
