import pytest


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    """Keep each phase's report on the test item, so a fixture can tell the test failed."""
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report
