from corolla.engine.pages import PageAllocator, pages_for


def test_allocation_growth_and_release():
    pages = PageAllocator(num_pages=6, page_size=4)
    table: list[int] = []
    assert pages.pages_needed(table, 0, 9) == 3
    assert pages.prepare_write(table, 0, 9) == []
    assert len(table) == 3 and pages.num_free == 3
    assert pages.pages_needed(table, 9, 12) == 0  # still inside the third page
    pages.prepare_write(table, 9, 13)
    assert len(table) == 4 and pages.num_free == 2
    pages.truncate(table, 5)
    assert len(table) == 2 and pages.num_free == 4
    pages.release_all(table)
    assert table == [] and pages.num_free == 6
    assert pages_for(0, 4) == 0 and pages_for(4, 4) == 1 and pages_for(5, 4) == 2


def test_fork_shares_pages_and_writes_copy_on_write():
    pages = PageAllocator(num_pages=8, page_size=4)
    tables = [[], []]
    for table in tables:
        pages.prepare_write(table, 0, 6)  # two rows, two pages each
    assert pages.num_free == 4
    forked = pages.fork(tables, [1, 1])  # both rows continue from row 1
    assert forked[0] == forked[1] and pages.num_free == 6  # row 0's pages went back to the pool
    assert pages.pages_needed(forked[0], 6, 7) == 1  # the shared partial page must be copied
    copies = pages.prepare_write(forked[0], 6, 7)
    assert len(copies) == 1 and copies[0][0] == forked[1][1] and copies[0][1] == forked[0][1]
    assert forked[0][0] == forked[1][0]  # the full first page stays shared
    for table in forked:
        pages.release_all(table)
    assert pages.num_free == 8
