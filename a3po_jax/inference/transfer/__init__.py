"""Inference layer (transfer): weight pushes from the trainer to a host, outside gRPC.

* `weight_sync`: whole-or-nothing weight validation and reusable host staging buffers.
* `framing`: the weight port's frames, the token handshake, the exchange they make up.
* `sender` / `receiver`: `WeightSender` (the pusher) and `WeightReceiver` (on the host).
* `shared_memory`: memfd sets and the raw region of a push on one machine.
* `layout`: the serving layout on the wire, laid out with numpy (the fused and transposed
  layer matrices), as the engine's `decode_layout` lays it out on the device.
"""
