def pytest_terminal_summary(terminalreporter):
    """The count of documented blocks run and only parsed (tests/docs/test_docs_pages.py)."""
    from tests.docs.test_docs_pages import docs_summary

    line = docs_summary()
    if line:
        terminalreporter.write_line(line)
