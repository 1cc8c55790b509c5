"""Early admission: pre-processing refuses while the denoise queue (plus requests on their way to it) is full."""

import pytest

from maskedit.admission import QueueBoard, board_path
from maskedit.errors import ResourceExhausted


def test_requests_on_their_way_to_denoise_count_against_its_queue(tmp_path):
    denoise, pre = QueueBoard(tmp_path / "b"), QueueBoard(tmp_path / "b")  # two processes' views of one file
    pre.check()  # nothing published yet: admit
    denoise.publish(waiting=1, max_queue=3)
    pre.check()
    pre.passed()
    pre.check()  # 1 waiting + 1 on its way < 3
    pre.passed()
    with pytest.raises(ResourceExhausted, match="denoise queue is full"):
        pre.check()  # 1 + 2 on their way: a third would find the queue full after pre-processing
    denoise.arrived()
    denoise.publish(waiting=1, max_queue=3)  # one arrived and another was admitted to the batch meanwhile
    pre.check()


def test_the_board_is_named_after_the_server(tmp_path):
    assert board_path(tmp_path, 1234) == tmp_path / "server-1234"
