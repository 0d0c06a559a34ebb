"""Pure decisions that servers, clients and `corolla sim` run alike: routing and placement."""
