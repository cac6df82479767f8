"""``rknpu bench concurrent``'s crowd: the stalled connections hold half a message, the others
probe and get answers, and the server serves them all at once (the benchmark itself needs
llama-server and a model, so it is a command, not a test)."""

from __future__ import annotations

import pytest

from ggml_rknpu.bench.concurrent import PROBE_PERIOD_S, Crowd, _pct
from ggml_rknpu.server.rpc.wire import Cmd
from support.rpc_testkit import serve, wait_until

pytestmark = pytest.mark.timeout(60)


def test_the_crowd_stalls_half_and_probes_with_the_other_half():
    with serve() as st:
        crowd = Crowd(st.port, 6, 3)
        try:
            assert st.server.wait_idle(timeout=5, leave=6) and st.server.session_count == 6
            assert wait_until(lambda: crowd.probes >= 3, timeout=20 * PROBE_PERIOD_S)
            assert crowd.probe_errors == []
            assert st.state.sessions.stalled == 0 and st.state.stats.commands[Cmd.HELLO] == 6
        finally:
            crowd.close()
        assert st.server.wait_idle(timeout=5)
        assert st.state.stats.rejected == 3          # the stallers' half messages, truncated by the close


def test_percentiles_pick_the_rank():
    lat = [float(i) for i in range(1, 101)]
    assert (_pct(lat, 0.50), _pct(lat, 0.99), _pct([3.0], 0.99)) == (51.0, 100.0, 3.0)
