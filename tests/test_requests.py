"""What a request's handle streams as its committed prefix grows (`Answers.stream`): the text of
the whole prefix, decoded one new token at a time."""

import asyncio
import threading
from functools import partial

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from dilaserve.cluster.loop_post import LoopPost
from dilaserve.cluster.requests import Answers, Overloaded, RequestHandle
from dilaserve.models.tokenizer import Tokenizer
from dilaserve.request import Request

from conftest import HANG_GUARD_S

TEXT = "Zoë pays 5 € for 3 crêpes."  # ë and ê take two tokens each, € three


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory) -> Tokenizer:
    """A byte-level tokenizer with no merges: every byte of UTF-8 is a token of its own."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    hf = HFTokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens(["<|mdm_mask|>", "<|eot_id|>"])
    folder = tmp_path_factory.mktemp("byte-tokenizer")
    hf.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text('{"eos_token": "<|eot_id|>"}')
    return Tokenizer(folder)


def stream_in_steps(tokenizer: Tokenizer, ids: list[int], per_step: int) -> list[str]:
    """The deltas a handle streams when `per_step` more of `ids` commit at each step, left to
    right, then the request finishes."""
    return list(run_in_steps(tokenizer, ids, per_step))


def text_request(tokenizer: Tokenizer, ids: list[int]) -> Request:
    """A request of one block, whose answer will be `ids` and then the end of text (its
    deadline a time on the tests' own clock: they finish it at 0.5, nothing waits)."""
    mask = tokenizer.special.mask
    return Request("r", (1,), len(ids) + 1, len(ids) + 1, mask, 0.9, deadline=1.0)


def run_in_steps(tokenizer: Tokenizer, ids: list[int], per_step: int, **handle) -> RequestHandle:
    """A request's handle (made with `handle`'s arguments) once `per_step` more of `ids` have
    committed at each step, left to right, and the request has finished."""
    request = text_request(tokenizer, ids)
    handle, answers = RequestHandle(request, 0.0, **handle), Answers(tokenizer)
    for end in range(per_step, len(ids) + per_step, per_step):
        request.output_ids[:end] = ids[:end]
        answers.stream(handle)
    request.output_ids[len(ids)] = tokenizer.special.eos
    answers.finish(handle, 0.5)
    return handle


class CountingLoop:
    """Stands for the server's event loop: counts the controller's wake-ups of it."""

    def __init__(self):
        self.wakeups = 0

    def call_soon_threadsafe(self, callback, *args) -> None:
        self.wakeups += 1


def test_split_characters_stream_whole(byte_tokenizer):
    ids = byte_tokenizer.encode(TEXT)
    assert len(ids) > len(TEXT)  # some characters are split across tokens
    for per_step in (1, 2, 3):
        deltas = stream_in_steps(byte_tokenizer, ids, per_step)
        assert "".join(deltas) == TEXT
        assert all("\ufffd" not in d for d in deltas)
    # one token a step: the two bytes of ë come out as one delta, after the second
    assert stream_in_steps(byte_tokenizer, ids, 1)[:3] == ["Z", "o", "ë"]


def test_the_stream_is_the_whole_prefix_decoded(tiny_tokenizer):
    ids = tiny_tokenizer.encode("Tom has 12 apples. Tom buys 5 more.\n#### 17")
    for per_step in (1, 4):
        deltas = stream_in_steps(tiny_tokenizer, ids, per_step)
        assert "".join(deltas) == tiny_tokenizer.decode(ids)
        assert len(deltas) > 1


def test_a_decode_stream_gives_decode_text(tiny_tokenizer, byte_tokenizer):
    for tokenizer in (tiny_tokenizer, byte_tokenizer):
        ids = tokenizer.encode(TEXT + " Tom has 12 apples.")
        stream = tokenizer.decode_stream()
        assert "".join(stream.add(ids[i : i + 3]) for i in range(0, len(ids), 3)) == (
            tokenizer.decode(ids)
        )


def test_a_request_not_streamed_wakes_no_event_loop(tiny_tokenizer):
    """Its caller awaits the result alone: each step's text sent to the event loop would be a
    wake-up of it from the controller's thread, for text nobody reads."""
    ids = tiny_tokenizer.encode("Tom has 12 apples. Tom buys 5 more.\n#### 17")
    streamed, plain = CountingLoop(), CountingLoop()
    run_in_steps(tiny_tokenizer, ids, 4, loop=streamed)
    handle = run_in_steps(tiny_tokenizer, ids, 4, loop=plain, stream=False)
    assert streamed.wakeups == 1 and plain.wakeups == 0  # (its deltas: one wake-up, `LoopPost`)
    assert handle.future.result().text == tiny_tokenizer.decode(ids)
    with pytest.raises(RuntimeError, match="stream=True"):
        list(handle)
    assert handle.sent_tokens == 0  # and nothing was decoded before it finished


def test_a_request_not_streamed_still_ends_at_its_stop_string(tiny_tokenizer):
    ids = tiny_tokenizer.encode("Tom has 12 apples. Tom buys 5 more.\n#### 17")
    request = text_request(tiny_tokenizer, ids)
    handle, answers = RequestHandle(request, 0.0, ("buys",), stream=False), Answers(tiny_tokenizer)
    stopped_at = None
    for end in range(4, len(ids) + 4, 4):
        request.output_ids[:end] = ids[:end]
        if answers.stream(handle):
            stopped_at = end
            break
    assert stopped_at is not None and stopped_at < len(ids)
    answers.finish(handle, 0.5)
    assert handle.future.result().text == "Tom has 12 apples. Tom "


def test_calls_posted_while_the_loop_is_busy_wake_it_once_and_run_in_order():
    seen = []

    async def main():
        post = LoopPost(asyncio.get_running_loop())
        controller = threading.Thread(target=lambda: [post.post(seen.append, i) for i in range(50)])
        controller.start()
        controller.join()  # (the loop is held meanwhile: every call is posted before it runs)
        await asyncio.sleep(0)
        return post.wakeups

    assert asyncio.run(main()) == 1 and seen == list(range(50))


def test_a_handle_tells_its_loop_of_its_admission_and_result(tiny_tokenizer):
    async def main():
        ids = tiny_tokenizer.encode("Tom has 12 apples.")
        request = text_request(tiny_tokenizer, ids)
        handle, answers = RequestHandle(request, 0.0), Answers(tiny_tokenizer)
        admitted, answered = handle.admitted(), handle.answered()

        def controller():  # admits it, commits it in two steps, finishes it
            handle.admission.set_result(None)
            for end in (3, len(ids)):
                request.output_ids[:end] = ids[:end]
                answers.stream(handle)
            request.output_ids[len(ids)] = tiny_tokenizer.special.eos
            answers.finish(handle, 0.5)

        await asyncio.to_thread(controller)
        deltas = [delta async for delta in handle]
        await asyncio.wait_for(answered, HANG_GUARD_S)
        return admitted.result(), "".join(deltas), answered.result().text

    admission, streamed, text = asyncio.run(main())
    assert admission is None and streamed == text == "Tom has 12 apples."


def test_a_refusal_reaches_the_loop_as_the_admissions_error(tiny_tokenizer):
    async def main():
        handle = RequestHandle(text_request(tiny_tokenizer, [7]), 0.0)
        admitted = handle.admitted()
        refuse = partial(Answers(tiny_tokenizer).refuse, handle, Overloaded("over capacity"))
        await asyncio.to_thread(refuse)
        await asyncio.wait([admitted], timeout=HANG_GUARD_S)
        return admitted.exception()

    assert isinstance(asyncio.run(main()), Overloaded)
