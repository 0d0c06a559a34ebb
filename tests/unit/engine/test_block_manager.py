from corolla.engine.block_manager import BlockManager, blocks_for


def test_allocation_growth_and_release():
    blocks = BlockManager(num_blocks=6, block_size=4)
    table: list[int] = []
    assert blocks.blocks_needed(table, 0, 9) == 3
    assert blocks.prepare_write(table, 0, 9) == []
    assert len(table) == 3 and blocks.num_free == 3
    assert blocks.blocks_needed(table, 9, 12) == 0  # still inside the third block
    blocks.prepare_write(table, 9, 13)
    assert len(table) == 4 and blocks.num_free == 2
    blocks.truncate(table, 5)
    assert len(table) == 2 and blocks.num_free == 4
    blocks.release_all(table)
    assert table == [] and blocks.num_free == 6
    assert blocks_for(0, 4) == 0 and blocks_for(4, 4) == 1 and blocks_for(5, 4) == 2


def test_fork_shares_blocks_and_writes_copy_on_write():
    blocks = BlockManager(num_blocks=8, block_size=4)
    tables = [[], []]
    for table in tables:
        blocks.prepare_write(table, 0, 6)  # two rows, two blocks each
    assert blocks.num_free == 4
    forked = blocks.fork(tables, [1, 1])  # both rows continue from row 1
    assert forked[0] == forked[1] and blocks.num_free == 6  # row 0's blocks went back to the pool
    assert blocks.blocks_needed(forked[0], 6, 7) == 1  # the shared partial block must be copied
    copies = blocks.prepare_write(forked[0], 6, 7)
    assert len(copies) == 1 and copies[0][0] == forked[1][1] and copies[0][1] == forked[0][1]
    assert forked[0][0] == forked[1][0]  # the full first block stays shared
    for table in forked:
        blocks.release_all(table)
    assert blocks.num_free == 8
