import pytest

from proserve.decode.status import StatusError, free_kv_blocks

PAGE = '''# HELP vllm:kv_cache_usage_perc KV-cache usage.
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:cache_config_info{block_size="128",engine="0",num_gpu_blocks="8192",num_cpu_blocks="None"} 1.0
'''


def test_free_blocks_from_vllm_metrics():
    assert free_kv_blocks(PAGE) == 6144
    assert free_kv_blocks(PAGE.replace("0.25", "0.0")) == 8192


@pytest.mark.parametrize("drop,what", [("kv_cache_usage_perc", "kv_cache_usage_perc"),
                                       ("cache_config_info", "num_gpu_blocks")])
def test_missing_metrics_are_named(drop, what):
    page = "\n".join(line for line in PAGE.splitlines() if drop not in line)
    with pytest.raises(StatusError, match=what):
        free_kv_blocks(page)
