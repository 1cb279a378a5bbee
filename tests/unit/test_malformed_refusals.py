"""When a prompt answered malformed on every try is its own failure, and when it is its endpoint's: malformed
answers are compared alike whatever the body they quote, and the pool says when it gives an endpoint up, whatever
the cause. Small classes, no server."""

from __future__ import annotations

import asyncio
import logging

from eagle3_datagen.config import ServerConfig
from eagle3_datagen.protocol import OpenAIClient, RequestFailed
from tasks.generation.pool import REPEATED_REFUSALS, Endpoint, EndpointPool, HeldRefusals
from tasks.generation.scheduler import alike, malformed_answer

ENDPOINT = "http://127.0.0.1:9"


def broken(response_id: str) -> RequestFailed:
    return RequestFailed(f'{ENDPOINT}: a choice is not an object: {{"id": "chatcmpl-{response_id}",\n "choices": '
                         "[null]}", 200, True)


def test_a_malformed_answer_is_rejected_with_its_error_in_one_line_and_all_are_alike_whatever_they_quote() -> None:
    first, second = malformed_answer(broken("a1"), 3), malformed_answer(broken("b2"), 3)
    assert first == (f'malformed answer to each of 3 tries: {ENDPOINT}: a choice is not an object: {{"id": '
                     '"chatcmpl-a1", "choices": [null]}')
    assert alike(first) == alike(second), "each response has its own id: an endpoint broken for all is one cause"
    assert alike("HTTP 400 from x: too long") != alike("HTTP 400 from x: bad roles"), "refusals by their message"


def test_malformed_answers_to_many_prompts_in_a_row_are_the_endpoints_and_an_answer_makes_them_their_prompts() -> None:
    held: HeldRefusals[tuple[str, str]] = HeldRefusals()
    for sent in range(REPEATED_REFUSALS - 1):
        reason = malformed_answer(broken(f"id{sent}"), 2)
        assert held.refused(ENDPOINT, sent, alike(reason), (reason, f"p{sent}")) == []
        assert not held.repeated(ENDPOINT, sent)
    last = malformed_answer(broken("last"), 2)
    held.refused(ENDPOINT, REPEATED_REFUSALS - 1, alike(last), (last, "last"))
    assert held.repeated(ENDPOINT, REPEATED_REFUSALS - 1), "the endpoint's: it is dropped, its prompts asked again"
    cleared = held.answered(ENDPOINT, REPEATED_REFUSALS)
    assert [item for _, (_, item) in cleared] == [f"p{sent}" for sent in range(REPEATED_REFUSALS - 1)] + ["last"]
    assert cleared[0][1][0] == malformed_answer(broken("id0"), 2), "each written with its own error"


def test_the_pool_says_when_it_gives_an_endpoint_up_for_errors_or_for_refusing_every_request() -> None:
    async def scenario() -> list[str]:
        dead: list[str] = []
        endpoints = [Endpoint(url, OpenAIClient(url, None, 5.0), limit=4) for url in (ENDPOINT, ENDPOINT + "1")]
        pool = EndpointPool(endpoints, ServerConfig(endpoints=[ENDPOINT, ENDPOINT + "1"], max_consecutive_errors=3),
                            logging.getLogger("test"), on_dead=dead.append)
        for _ in range(3):
            slot = await pool.acquire()
            assert slot is not None and slot[0].url == ENDPOINT
            pool.release(*slot, broken("x"))
        assert dead == [ENDPOINT] and endpoints[0].dead
        pool.drop(ENDPOINT + "1", "the key is refused")
        return dead

    assert asyncio.run(scenario()) == [ENDPOINT, ENDPOINT + "1"]
