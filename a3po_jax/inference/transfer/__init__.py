"""Inference layer (transfer): weight pushes from the trainer to a host, outside gRPC.

* `weight_sync`: whole-or-nothing weight validation and reusable host staging buffers.
* `weight_transfer`: the push itself (`WeightSender` / `WeightReceiver`).
"""
