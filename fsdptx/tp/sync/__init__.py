"""TP-replica synchronization: keep tensor-parallel replicas identical.

Under sequence parallelism, parameters every TP rank holds in full (norm
weights, biases, router parameters) receive a different gradient on each TP
rank; reducing them once per optimizer step keeps the replicas from
drifting. One concept per file: who the peers are and what they hold alike
(``_context``), which tensors take part and in which order, cached on the
model (``_layout``), how they travel in bounded buffers (``_schedule``), what
the peers agree on before any collective (``_agreement``), and the public
operations (``_ops``)."""
