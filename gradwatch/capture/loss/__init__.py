"""What ``Tensor.backward`` is called on: the loss, its graph, the loose leaves it trains, its terms."""
