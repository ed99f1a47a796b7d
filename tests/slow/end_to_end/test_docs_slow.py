"""The slow tier beside tests/end_to_end/test_docs.py: longer runs, more settings.

The built site in a real headless browser (Debian's chromium, driven by selenium; .ci/run
installs both): the home page, a tutorial and a reference page render with their
navigation, and the site's own search box finds config keys.
"""

import functools
import http.server
import shutil
import threading

import pytest
from test_docs import build_site

WAIT_S = 30


@pytest.fixture(scope="module")
def site_url(tmp_path_factory):
    """The site built as CI builds it, served on 127.0.0.1 (search fetches its index)."""
    site = tmp_path_factory.mktemp("site")
    build_site(site)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    chromium, chromedriver = shutil.which("chromium"), shutil.which("chromedriver")
    assert chromium and chromedriver, (
        "chromium or chromedriver is missing: apt-get install chromium chromium-driver "
        "(.ci/run does)"
    )
    options = Options()
    # A desktop's width: narrower, the theme folds its navigation tabs into a menu.
    arguments = ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1400,1000")
    for argument in (*arguments, "--disable-dev-shm-usage"):
        options.add_argument(argument)
    options.binary_location = chromium
    driver = webdriver.Chrome(service=Service(chromedriver), options=options)
    yield driver
    driver.quit()


def shown(browser, selector):
    """The text of the first element `selector` matches, once the page shows it."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    located = (By.CSS_SELECTOR, selector)
    return (
        WebDriverWait(browser, WAIT_S)
        .until(expected_conditions.visibility_of_element_located(located))
        .text
    )


@pytest.mark.parametrize(
    ("page", "heading"),
    [
        ("/", "paisoar_jax"),
        ("/tutorials/first-run/", "First run"),
        ("/reference/config/", "Config keys"),
    ],
)
def test_pages_render_with_their_navigation(browser, site_url, page, heading):
    browser.get(site_url + page)
    assert shown(browser, "article h1") == heading
    tabs = shown(browser, ".md-tabs")  # the sections as tabs across the top
    for section in ("Tutorials", "How-to", "Reference", "Explanation"):
        assert section in tabs, tabs


@pytest.mark.parametrize("key", ["train.grad_accum", "optim.clip_norm", "data.workers"])
def test_the_search_box_finds_a_config_key(browser, site_url, key):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(site_url + "/")
    shown(browser, "input.md-search__input")
    box = browser.find_element(By.CSS_SELECTOR, "input.md-search__input")
    box.click()
    box.send_keys(key)

    def results(driver):
        items = driver.find_elements(By.CSS_SELECTOR, ".md-search-result__item")
        return [item.text for item in items if key in item.text] or False

    found = WebDriverWait(browser, WAIT_S).until(results)
    assert found, key
