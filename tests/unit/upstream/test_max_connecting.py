"""`upstream_max_connecting` left unset: sized by the kernel's cap on a listen queue (proxy/upstream/pool.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.upstream.pool import MAX_CONNECTING, default_max_connecting


@pytest.mark.parametrize(
    ("somaxconn", "expected"),
    [
        ("4096\n", MAX_CONNECTING),  # Linux 5.4 and later: vLLM's own backlog (2,048) is what caps its queue
        ("128\n", 128),  # before 5.4: every listen queue holds 128, so no more handshakes than that at once
        ("512\n", 512),
        ("0\n", 1),
    ],
)
def test_the_default_is_1024_or_the_kernels_cap_where_lower(tmp_path: Path, somaxconn: str, expected: int) -> None:
    cap = tmp_path / "somaxconn"
    cap.write_text(somaxconn)
    assert default_max_connecting(cap) == expected


@pytest.mark.parametrize("content", [None, "", "many\n"])
def test_a_cap_that_cannot_be_read_gives_128_the_smallest_a_kernel_has(tmp_path: Path, content: str | None) -> None:
    cap = tmp_path / "somaxconn"
    if content is not None:
        cap.write_text(content)
    assert default_max_connecting(cap) == 128
