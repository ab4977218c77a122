"""Image references and allow-list patterns: one judgement for the agent and the scheduler."""

from __future__ import annotations

import pytest

from agentprotocol.images import allow_patterns, image_allowed, image_normalize


@pytest.mark.parametrize(
    ("image", "normalized"),
    [
        ("ubuntu", "ubuntu:latest"),
        ("ubuntu:22.04", "ubuntu:22.04"),
        ("127.0.0.1:5000/team/train", "127.0.0.1:5000/team/train:latest"),
        ("127.0.0.1:5000/team/train:v1", "127.0.0.1:5000/team/train:v1"),
        ("repo@sha256:abc", "repo@sha256:abc"),
    ],
)
def test_a_reference_names_its_tag_as_docker_pulls_it(image, normalized):
    assert image_normalize(image) == normalized


def test_patterns_match_the_normalized_reference_and_none_admits_any():
    assert image_allowed(("gpumarket/harness:*",), "gpumarket/harness:dev")
    assert not image_allowed(("gpumarket/harness:*",), "gpumarket/harness-evil:dev")
    assert image_allowed(("ubuntu:latest",), "ubuntu")  # the implicit tag
    assert image_allowed(("*",), "ghcr.io/a/b:c")  # "*" crosses "/" and ":"
    assert not image_allowed((), "ubuntu")
    assert image_allowed(None, "anything/at:all")


def test_the_agents_entries_give_their_patterns_without_the_user():
    assert allow_patterns(["nvcr.io/nvidia/pytorch:*=0:0", " a/* ", ""]) == (
        "nvcr.io/nvidia/pytorch:*",
        "a/*",
    )
