"""The KV digest (issue 51) on real engines, attention kinds: full attention (Llama) and a
sliding window beside full attention (Gemma 3). Every push write is flipped in flight and the
digest is on for every request: each request is caught at decode, recomputed there, and
answered as decode alone answers it; the proxy's record and metric name the digest
(``digest_engines.py``; MLA and a GDN state: ``test_kv_digest_mla_gdn_engines.py``)."""

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


@pytest.mark.parametrize("flipped", ["llama", "gemma3"], indirect=True)
def test_every_flipped_push_is_caught_and_recomputed(flipped: LocalPD) -> None:
    assert_every_request_caught(flipped)
