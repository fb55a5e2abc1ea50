"""The gradient of a fan-in bridge split by what each encoder rank sent.

With more encoder data-parallel ranks than LLM ranks (fan-in), megatron-core 0.19.2's bridge concatenates the
encoder ranks' outputs for one LLM rank, then splits that rank's gradient back into equal pieces. The pieces differ
whenever the encoder ranks sent different numbers of rows (a micro-batch without an image, images of other
sizes), and the encoders' backward then fails on a shape mismatch. This adapter remembers the rows each source
sent with every forward it receives and splits the matching gradient by them: the schedules run backwards in the
order of the forwards (1F1B), so a queue pairs them.

One module with one job, replaceable when a megatron-core release routes the sizes itself.
"""

from __future__ import annotations

from collections import deque
from functools import cache


def split_gradients_by_received_rows(communicator) -> None:
    """Make every bridge of a MultiModulePipelineCommunicator split its backward by the received rows."""
    for bridge in communicator.bridge_comms:
        bridge.__class__ = _splitting_by_received_rows(type(bridge))  # only methods are added
        bridge._received_rows = deque(maxlen=_IN_FLIGHT)


# 1F1B holds at most the warm-up micro-batches in flight; forward-only evaluation never takes its sizes
_IN_FLIGHT = 4096


@cache
def _splitting_by_received_rows(bridge_class):
    """`bridge_class` (megatron-core's bridge, or a narrowing of it such as cp_bridge's) that also splits its
    backward by the rows each source sent."""

    class FanInBridge(bridge_class):
        def _communicate_shapes(self, tensor_to_send_next=None, recv_next=False, recv_prev=False,
                                tensor_to_send_prev=None):
            forward_shapes, grad_shapes = super()._communicate_shapes(
                tensor_to_send_next=tensor_to_send_next, recv_next=recv_next, recv_prev=recv_prev,
                tensor_to_send_prev=tensor_to_send_prev)
            if recv_prev and forward_shapes:  # the LLM's leader receives a forward: rows per source rank
                self._received_rows.append([int(shape[self._batch_dim]) for shape in forward_shapes])
            return forward_shapes, grad_shapes

        def _split_tensor_at_batch_dim(self, aggregated_tensor, num_splits):
            # On the LLM's side a split is a gradient going back to the sources of the oldest forward.
            if self.is_current_rank_in_grid(self.dest_grid) and self._received_rows:
                rows = self._received_rows.popleft()
                if len(rows) == num_splits and getattr(aggregated_tensor, "_mimo_bridge_split_sizes", None) is None:
                    aggregated_tensor._mimo_bridge_split_sizes = rows
            return super()._split_tensor_at_batch_dim(aggregated_tensor, num_splits)

    return FanInBridge
