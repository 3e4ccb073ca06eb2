"""/metrics text from the engine's statistics: DSpark acceptance counters sum the finished requests'."""

from deepinfer.engine.stats import EngineStats
from deepinfer.entrypoints.openai.metrics import render
from tests.support.server import parse_metrics


def test_spec_decode_counters_sum_finished_requests():
    stats = EngineStats()
    stats.add_spec(num_drafts=3, num_draft_tokens=12, num_accepted=7, per_pos=[3, 2, 1, 1])
    stats.add_spec(num_drafts=2, num_draft_tokens=4, num_accepted=1, per_pos=[1])
    m = parse_metrics(render(stats, "tiny"))
    label = 'model_name="tiny"'
    assert m[f"deepinfer:spec_decode_num_drafts_total{{{label}}}"] == 5
    assert m[f"deepinfer:spec_decode_num_draft_tokens_total{{{label}}}"] == 16
    assert m[f"deepinfer:spec_decode_num_accepted_tokens_total{{{label}}}"] == 8
    per_pos = [m[f'deepinfer:spec_decode_num_accepted_tokens_per_pos_total{{{label},position="{i}"}}']
               for i in range(4)]
    assert per_pos == [4, 2, 1, 1] and sum(per_pos) == 8
