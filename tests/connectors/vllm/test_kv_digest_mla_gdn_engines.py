"""The KV digest (issue 51) on real engines, MLA (DeepSeek) and a Gated DeltaNet state beside
full attention (Qwen3-Next, its state in float32): as ``test_kv_digest_engines.py`` for the
attention kinds, every flipped push is caught, recomputed and answered right
(``digest_engines.py``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from app.harness.local_pd import LocalPD
from tests.connectors.vllm.digest_engines import assert_every_request_caught, flipped_pair

pytestmark = pytest.mark.slow_engines


@pytest.fixture(scope="module")
def flipped(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalPD]:
    kind = str(request.param)
    with flipped_pair(kind, tmp_path_factory.mktemp(f"digest-{kind}")) as stack:
        yield stack


@pytest.mark.parametrize("flipped", ["deepseek", "qwen3next"], indirect=True)
def test_every_flipped_push_is_caught_and_recomputed(flipped: LocalPD) -> None:
    assert_every_request_caught(flipped)
