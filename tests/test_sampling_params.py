"""SamplingParams: defaults follow vLLM, every bad value fails at construction naming the parameter."""
import pytest

from pyengine.sampling_params import SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == (1, 1.0, 1.0, -1, 0.0, 16)
    assert p.stop == [] and p.stop_token_ids == [] and p.logit_bias == {}
    assert (p.ignore_eos, p.seed, p.logprobs) == (False, None, None)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert p.skip_special_tokens is True and p.include_stop_str_in_output is False
    assert not p.greedy and not p.has_penalties


@pytest.mark.parametrize("kwargs, name", [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_p": -1}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"min_p": -0.01}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"max_tokens": "10"}, "max_tokens"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"n": 0}, "n"),
    ({"n": True}, "n"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": 1.5}, "logprobs"),
    ({"logprobs": "5"}, "logprobs"),
    ({"seed": -3}, "seed"),
    ({"seed": 1.5}, "seed"),
    ({"stop": 5}, "stop"),
    ({"stop": ["ok", 3]}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [1, -2]}, "stop_token_ids"),
    ({"stop_token_ids": "12"}, "stop_token_ids"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"logit_bias": {"x": 1.0}}, "logit_bias"),
    ({"logit_bias": {5: 101.0}}, "logit_bias"),
    ({"logit_bias": {5: "high"}}, "logit_bias"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
])
def test_invalid_values_name_the_parameter(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


def test_normalisation():
    p = SamplingParams(stop="###", stop_token_ids=(7, 9), logit_bias={"12": -100, 3: 2.5}, top_k=3.0,
                       max_tokens=None)
    assert p.stop == ["###"]
    assert p.stop_token_ids == [7, 9]
    assert p.logit_bias == {12: -100.0, 3: 2.5}
    assert p.top_k == 3 and isinstance(p.top_k, int)
    assert p.max_tokens is None
    assert SamplingParams(stop=["a", "b", "a"]).stop == ["a", "b"]


def test_greedy_threshold():
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=5e-6).greedy
    assert not SamplingParams(temperature=1e-4).greedy


def test_validate_for_vocab():
    SamplingParams(logit_bias={99: 1.0}, stop_token_ids=[99], logprobs=20).validate_for_vocab(100)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={100: 1.0}).validate_for_vocab(100)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[5, 100]).validate_for_vocab(100)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=101).validate_for_vocab(100)


def test_clone_revalidates_and_copies():
    p = SamplingParams(temperature=0.5, stop=["x"], seed=1)
    q = p.clone(seed=2)
    assert q.seed == 2 and q.temperature == 0.5 and q.stop == ["x"] and q.stop is not p.stop
    with pytest.raises(ValueError, match="top_p"):
        p.clone(top_p=2.0)
