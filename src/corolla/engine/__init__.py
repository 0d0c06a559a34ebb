"""Continuous batching on a server: sessions' steps packed into one pass over a paged cache.

sequence.py (what is worked on), block_manager.py (the paged cache's blocks), scheduler.py (what runs in
the next pass), model_runner.py (running the span over a packed batch), engine.py (step = schedule ->
run -> postprocess), async_engine.py (the asyncio front). No networking here.
"""
