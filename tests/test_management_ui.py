"""The management web UI in a real browser: Debian's headless Chromium driven by Selenium.

Logs in, sees a queue declared through AMQP with its message count, publishes and gets a message
on the queue page, deletes the queue. Each run keeps screenshots of the overview and the queue page in
test-artifacts/screenshots/ (git-ignored, so a run leaves the tree clean); the ones shown in
docs/management.md (docs/images/) are copies of such a run's.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from pika.exceptions import ChannelClosedByBroker
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support import expected_conditions as EC
from selenium.webdriver.support.ui import WebDriverWait

from tests.helpers import uid

pytestmark = pytest.mark.integration

SHOTS = Path(__file__).resolve().parent.parent / "test-artifacts" / "screenshots"


@pytest.fixture
def browser(tmp_path):
    chromium = shutil.which("chromium")
    driver_path = shutil.which("chromedriver")
    assert chromium and driver_path, "chromium and chromium-driver must be installed (scripts/test.sh does it)"
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage",
                f"--user-data-dir={tmp_path / 'chromium-profile'}", "--window-size=1280,1300"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(driver_path), options=opts)
    try:
        yield driver
    finally:
        driver.quit()


def test_ui_login_queue_publish_get_delete(node_factory, browser):
    node = node_factory(name="node", extra_args=["--stats-interval", "200"])
    qn = uid("ui")
    conn = node.connect()
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare(qn, durable=True)
    for i in range(3):
        ch.basic_publish("", qn, f"from amqp {i}".encode())
    wait = WebDriverWait(browser, 15)
    browser.get(f"http://127.0.0.1:{node.http_port}/")
    wait.until(EC.visibility_of_element_located((By.ID, "login-user"))).send_keys("guest")
    browser.find_element(By.ID, "login-pass").send_keys("wrong")
    browser.find_element(By.ID, "login-button").click()
    wait.until(EC.text_to_be_present_in_element((By.ID, "login-error"), "Login failed"))
    browser.find_element(By.ID, "login-pass").clear()
    browser.find_element(By.ID, "login-pass").send_keys("guest")
    browser.find_element(By.ID, "login-button").click()
    wait.until(EC.text_to_be_present_in_element((By.ID, "whoami"), "guest"))
    wait.until(EC.text_to_be_present_in_element((By.ID, "total-queues"), "1"))
    wait.until(EC.presence_of_element_located((By.ID, "rates")))
    SHOTS.mkdir(parents=True, exist_ok=True)
    browser.save_screenshot(str(SHOTS / "management-overview.png"))

    browser.find_element(By.ID, "nav-queues").click()
    row = wait.until(EC.presence_of_element_located((By.XPATH, f"//table[@id='queues-table']//tr[td/a[text()='{qn}']]")))
    # The count arrives with the shards' periodic stats: wait for it (the page refreshes every 5 s).
    WebDriverWait(browser, 15).until(lambda d: d.find_element(
        By.XPATH, f"//table[@id='queues-table']//tr[td/a[text()='{qn}']]/td[6]").text == "3")
    row = browser.find_element(By.XPATH, f"//table[@id='queues-table']//tr[td/a[text()='{qn}']]")
    row.find_element(By.CLASS_NAME, "queue-link").click()
    wait.until(EC.text_to_be_present_in_element((By.ID, "queue-name"), qn))
    assert browser.find_element(By.ID, "queue-total").text == "3"

    browser.find_element(By.ID, "publish-payload").send_keys("hello from the browser")
    browser.find_element(By.ID, "publish-button").click()
    wait.until(EC.text_to_be_present_in_element((By.ID, "publish-msg"), "Message published."))
    browser.find_element(By.CSS_SELECTOR, "#get-form input[name=count]").clear()
    browser.find_element(By.CSS_SELECTOR, "#get-form input[name=count]").send_keys("4")
    browser.find_element(By.ID, "get-button").click()
    wait.until(lambda d: len(d.find_elements(By.CLASS_NAME, "got-payload")) == 4)
    payloads = [e.text for e in browser.find_elements(By.CLASS_NAME, "got-payload")]
    assert payloads == ["from amqp 0", "from amqp 1", "from amqp 2", "hello from the browser"]
    browser.execute_script("window.scrollTo(0, 0)")
    browser.save_screenshot(str(SHOTS / "management-queue.png"))
    # ack_requeue_true put them back: AMQP still sees all four.
    assert ch.queue_declare(qn, passive=True).method.message_count == 4

    browser.find_element(By.ID, "delete-button").click()
    wait.until(EC.alert_is_present()).accept()
    wait.until(lambda d: d.current_url.endswith("#/queues"))
    wait.until(lambda d: not d.find_elements(By.XPATH, f"//a[text()='{qn}']"))
    conn.close()
    # No script errors on any page we went through (the expected 401 of the wrong password aside).
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE" and "401" not in e["message"]]
    assert errors == []
    check = node.connect().channel()
    with pytest.raises(ChannelClosedByBroker) as info:
        check.queue_declare(qn, passive=True)
    assert info.value.reply_code == 404


def test_ui_admin_adds_vhost_user_and_permission(node_factory, browser):
    """The admin page: a vhost, a user and its permission made in the browser let that user in over AMQP."""
    import pika

    node = node_factory(name="node", frontends=1, shards=1)
    wait = WebDriverWait(browser, 15)
    browser.get(f"http://127.0.0.1:{node.http_port}/")
    wait.until(EC.visibility_of_element_located((By.ID, "login-user"))).send_keys("guest")
    browser.find_element(By.ID, "login-pass").send_keys("guest")
    browser.find_element(By.ID, "login-button").click()
    wait.until(EC.text_to_be_present_in_element((By.ID, "whoami"), "guest"))
    browser.find_element(By.ID, "nav-admin").click()

    def fill(form: str, **values: str) -> None:
        f = wait.until(EC.presence_of_element_located((By.ID, form)))
        for name, value in values.items():
            field = f.find_element(By.NAME, name)
            field.clear()
            field.send_keys(value)
        f.find_element(By.TAG_NAME, "button").click()

    fill("add-vhost", name="uivhost", description="made in the browser")
    wait.until(EC.text_to_be_present_in_element((By.ID, "vhosts-table"), "uivhost"))
    fill("add-user", name="uiuser", password="uipass", tags="management")
    wait.until(EC.text_to_be_present_in_element((By.ID, "users-table"), "uiuser"))
    fill("set-perm", user="uiuser", vhost="uivhost", configure=".*", write=".*", read=".*")
    wait.until(EC.text_to_be_present_in_element((By.ID, "permissions-table"), "uiuser"))
    conn = pika.BlockingConnection(pika.ConnectionParameters(
        host="127.0.0.1", port=node.port, virtual_host="uivhost", credentials=pika.PlainCredentials("uiuser", "uipass"),
        connection_attempts=1))
    assert conn.is_open
    conn.close()
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert errors == []
