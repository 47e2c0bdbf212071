"""Schema-driven fuzzing of the HTTP API: whatever schemathesis sends, no 5xx and no leaked block."""

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.entrypoints.server_helpers import blocks_at_rest, running_server, wait_idle


@pytest.fixture(scope="module")
def fuzz_server(smollm2):
    # A short context keeps every generated request to a few dozen steps.
    with running_server(smollm2, max_model_len=32, num_device_blocks=64, block_size=8) as served:
        yield served


def test_no_server_errors(fuzz_server):
    schema = schemathesis.openapi.from_url(f"{fuzz_server[0]}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/v1/models"}
    for operation in operations:
        @given(case=operation.as_strategy())
        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def call(case):
            response = case.call(timeout=60)
            assert response.status_code < 500, \
                f"{case.method} {case.path} -> {response.status_code}: {response.text[:300]}"
        call()


def test_no_blocks_left_after_fuzzing(fuzz_server):
    base, engine = fuzz_server
    wait_idle(engine)
    blocks = blocks_at_rest(base)
    assert blocks["used"] == 0 and blocks["in_flight"] == 0
