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

WAIT_S = 60  # the search index loads in a worker: slow on a loaded 2-core machine


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


def search(browser, site_url, text, answers):
    """Types `text` into the home page's search box; `answers(driver)` once it is truthy.

    The theme's worker loads the search index after the page: the query is typed only once
    the box says it is ready, as a query typed before could be lost on a loaded machine.
    """
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(site_url + "/")
    shown(browser, "input.md-search__input")
    box = browser.find_element(By.CSS_SELECTOR, "input.md-search__input")
    box.click()

    def ready(driver):
        meta = driver.find_elements(By.CSS_SELECTOR, ".md-search-result__meta")
        return bool(meta) and meta[0].text not in ("", "Initializing search")

    WebDriverWait(browser, WAIT_S).until(ready)
    box.send_keys(text)
    return WebDriverWait(browser, WAIT_S).until(answers)


@pytest.mark.parametrize("key", ["train.grad_accum", "optim.clip_norm", "data.workers"])
def test_the_search_box_finds_a_config_key(browser, site_url, key):
    from selenium.webdriver.common.by import By

    def results(driver):
        items = driver.find_elements(By.CSS_SELECTOR, ".md-search-result__item")
        return [item.text for item in items if key in item.text] or False

    assert search(browser, site_url, key, results), key


def test_the_search_box_finds_an_api_name(browser, site_url):
    """Before: searching plan_fit found only the architecture page."""
    from selenium.webdriver.common.by import By

    def api_results(driver):
        links = driver.find_elements(By.CSS_SELECTOR, ".md-search-result__link")
        found = [link.get_attribute("href") for link in links]
        return [href for href in found if "reference/api/" in href] or False

    assert search(browser, site_url, "plan_fit", api_results)


def test_the_api_page_shows_each_name_under_its_heading(browser, site_url):
    from selenium.webdriver.common.by import By

    browser.get(site_url + "/reference/api/")
    shown(browser, "article h1")
    headings = [element.text for element in browser.find_elements(By.CSS_SELECTOR, "h3.doc")]
    for name in ("fit", "prepare", "plan_fit", "FitResult", "Prepared", "Generator"):
        assert any(heading.endswith(name) for heading in headings), (name, headings)
    signatures = browser.find_elements(By.CSS_SELECTOR, ".doc-signature")
    assert len(signatures) >= 20 and all(s.is_displayed() for s in signatures[:5])


def test_a_config_keys_anchor_shows_its_row(browser, site_url):
    from selenium.webdriver.common.by import By

    browser.get(site_url + "/reference/config/#train.grad_accum")
    shown(browser, "article h1")
    anchor = browser.find_element(By.ID, "train.grad_accum")
    row = anchor.find_element(By.XPATH, "./ancestor::tr")
    top = browser.execute_script("return arguments[0].getBoundingClientRect().top", row)
    assert 0 <= top < 1000, top  # scrolled to it, in the window
    assert "micro-batches" in row.text


@pytest.mark.parametrize(
    "page",
    [
        "/",
        "/install/",
        "/tutorials/own-model/",
        "/how-to/meshes/",
        "/how-to/multi-process/",
        "/how-to/cloud/",
        "/reference/config/",
        "/reference/api/",
        "/reference/glossary/",
        "/benchmarks/",
    ],
)
def test_no_code_block_or_table_scrolls_sideways(browser, site_url, page):
    """At 1400 px. Before: 87 of 108 code blocks and 12 tables scrolled."""
    browser.get(site_url + page)
    shown(browser, "article h1")
    scrolling = browser.execute_script(
        """
        const found = [];
        for (const element of document.querySelectorAll('article pre > code, article table')) {
          const box = element.tagName === 'TABLE'
            ? (element.closest('.md-typeset__scrollwrap') || element.parentElement) : element;
          if (box.scrollWidth > box.clientWidth + 1)
            found.push(element.innerText.slice(0, 60));
        }
        return found;
        """
    )
    allowed = {"/benchmarks/": 3}  # the lab notebook's widest tables of plans
    assert len(scrolling) <= allowed.get(page, 0), scrolling
