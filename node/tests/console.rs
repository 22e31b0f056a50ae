//! The operator console in a real headless Chromium, driven over the DevTools protocol:
//! sign in, see the exact pending input rendered as text (a `<script>` in it stays
//! inert), approve it, and save a screenshot as a test artifact.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use base64::Engine;
use futures_util::{SinkExt, StreamExt};
use reqwest::StatusCode;
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::Message;
use util::{free_port, program_or_skip};

#[path = "cluster/util.rs"]
mod util;

const ADMIN: &str = "console-test-admin-token-0123456789abcdef";
const HOSTILE_INPUT: &str =
    "<script>window.__pwned=1</script><img src=x onerror=\"window.__pwned=2\">";

struct Kill(Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

type Socket =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// A minimal DevTools protocol client for one page.
struct Page {
    socket: Socket,
    next_id: u64,
}

impl Page {
    async fn call(&mut self, method: &str, params: Value) -> Value {
        self.next_id += 1;
        let id = self.next_id;
        let message = json!({"id": id, "method": method, "params": params}).to_string();
        self.socket
            .send(Message::Text(message.into()))
            .await
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            let frame = tokio::time::timeout(remaining, self.socket.next())
                .await
                .unwrap_or_else(|_| panic!("no answer to {method}"))
                .expect("socket open")
                .expect("frame");
            if let Message::Text(text) = frame {
                let reply: Value = serde_json::from_str(&text).unwrap();
                if reply["id"] == id {
                    assert!(reply.get("error").is_none(), "{method}: {reply}");
                    return reply["result"].clone();
                }
            }
        }
    }

    async fn eval(&mut self, expression: &str) -> Value {
        let result = self
            .call(
                "Runtime.evaluate",
                json!({"expression": expression, "awaitPromise": true, "returnByValue": true}),
            )
            .await;
        assert!(
            result.get("exceptionDetails").is_none(),
            "{expression}: {result}"
        );
        result["result"]["value"].clone()
    }

    /// Evaluates `expression` until it is truthy (bounded).
    async fn wait_for(&mut self, expression: &str) -> Value {
        let start = Instant::now();
        loop {
            let value = self.eval(expression).await;
            if !(value.is_null()
                || value == json!(false)
                || value == json!(0)
                || value == json!(""))
            {
                return value;
            }
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "never true: {expression}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

async fn start_node(http: &reqwest::Client) -> (Kill, String, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let bind = format!("127.0.0.1:{}", free_port());
    let child = Command::new(env!("CARGO_BIN_EXE_lineage-node"))
        .env("GUARD_DATA_DIR", dir.path())
        .env("GUARD_BIND", &bind)
        .env("GUARD_ADMIN_TOKEN", ADMIN)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let base = format!("http://{bind}");
    let start = Instant::now();
    while !http
        .get(format!("{base}/readyz"))
        .send()
        .await
        .is_ok_and(|r| r.status() == StatusCode::OK)
    {
        assert!(start.elapsed() < Duration::from_secs(15), "node not ready");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    (Kill(child), base, dir)
}

async fn open_page(
    chromium: &PathBuf,
    http: &reqwest::Client,
    profile: &std::path::Path,
) -> (Kill, Page) {
    let port = free_port();
    let child = Command::new(chromium)
        .args([
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--window-size=1280,1000",
        ])
        .arg(format!("--remote-debugging-port={port}"))
        .arg(format!("--user-data-dir={}", profile.display()))
        .arg("about:blank")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let browser = Kill(child);
    let start = Instant::now();
    let ws_url = loop {
        if let Ok(reply) = http
            .get(format!("http://127.0.0.1:{port}/json/list"))
            .send()
            .await
        {
            if let Ok(targets) = reply.json::<Vec<Value>>().await {
                if let Some(page) = targets.iter().find(|t| t["type"] == "page") {
                    break page["webSocketDebuggerUrl"].as_str().unwrap().to_string();
                }
            }
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "chromium did not start"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let (socket, _) = tokio_tungstenite::connect_async(ws_url).await.unwrap();
    (browser, Page { socket, next_id: 0 })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[expect(
    clippy::too_many_lines,
    reason = "a scenario test: one browser session, in order"
)]
async fn sign_in_see_the_exact_input_as_text_and_approve() {
    let Some(chromium) = program_or_skip(
        &["chromium", "chromium-browser", "google-chrome"],
        "LINEAGE_REQUIRE_CHROMIUM",
    ) else {
        return;
    };
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let (_node, base, _data) = start_node(&http).await;

    // The console's own headers.
    let page = http.get(format!("{base}/")).send().await.unwrap();
    let csp = page.headers()["content-security-policy"]
        .to_str()
        .unwrap()
        .to_string();
    assert!(
        csp.contains("script-src 'self'") && !csp.contains("unsafe-inline"),
        "{csp}"
    );
    assert_eq!(page.headers()["x-content-type-options"], "nosniff");

    // An agent asks for an action whose input carries markup.
    let policy = json!({"budget": 100, "scar_limit": 10, "tools": {"send": {"cost": 3, "requires_approval": true}}});
    let created: Value = http
        .post(format!("{base}/v1/agents"))
        .bearer_auth(ADMIN)
        .json(&json!({"agent_id": "mallory", "policy": policy}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let token = created["token"].as_str().unwrap();
    let decision: Value = http
        .post(format!("{base}/v1/agents/mallory/actions"))
        .bearer_auth(token)
        .json(&json!({"tool": "send", "input": {"body": HOSTILE_INPUT}}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(decision["decision"], "pending_approval");

    let profile = tempfile::tempdir().unwrap();
    let (_browser, mut page) = open_page(&chromium, &http, profile.path()).await;
    page.call("Page.enable", json!({})).await;
    page.call("Page.navigate", json!({"url": format!("{base}/")}))
        .await;
    page.wait_for("document.readyState === 'complete' && !!document.getElementById('signin-form')")
        .await;

    // A wrong token is refused; the right one signs in.
    page.eval("document.getElementById('token').value = 'wrong'; document.getElementById('signin-form').requestSubmit(); true").await;
    page.wait_for("document.getElementById('signin-error').textContent")
        .await;
    page.eval(&format!(
        "document.getElementById('token').value = '{ADMIN}'; document.getElementById('signin-form').requestSubmit(); true"
    ))
    .await;
    page.wait_for("document.querySelector('#agents-table tbody tr[data-agent=\"mallory\"]')")
        .await;
    page.wait_for("document.querySelector('#cluster-table tbody tr')")
        .await;
    // The all-agents queue counts what waits, and the agent's row is highlighted.
    page.wait_for("document.getElementById('queue-count').textContent === '1'")
        .await;
    assert_eq!(
        page.eval("document.querySelector('#agents-table tbody tr[data-agent=\"mallory\"]').classList.contains('has-pending')")
            .await,
        true
    );
    page.eval(
        "document.querySelector('#agents-table tbody tr[data-agent=\"mallory\"]').click(); true",
    )
    .await;
    let shown = page
        .wait_for("document.querySelector('#pending li[data-action=\"act-1\"] .pending-input')?.textContent")
        .await;
    let shown = shown.as_str().unwrap();
    assert!(
        shown.contains(&serde_json::to_string(HOSTILE_INPUT).unwrap()[1..20]),
        "{shown}"
    );
    assert!(
        shown.contains("<script>window.__pwned=1</script>"),
        "the exact input, as text: {shown}"
    );
    assert_eq!(
        page.eval("typeof window.__pwned").await,
        "undefined",
        "agent input executed"
    );
    page.wait_for("document.querySelectorAll('#log-table tbody tr').length === 4")
        .await;
    // The log shows the newest record first.
    assert_eq!(
        page.eval("document.querySelector('#log-table tbody tr td').textContent")
            .await,
        "3"
    );
    assert_eq!(
        page.eval("document.getElementById('error').textContent")
            .await,
        "",
        "the console showed an error"
    );
    assert_eq!(
        page.eval("document.querySelectorAll('#pending script, #pending img').length")
            .await,
        0
    );

    // A screenshot for people to look at.
    let shot = page
        .call("Page.captureScreenshot", json!({"format": "png"}))
        .await;
    let png = base64::engine::general_purpose::STANDARD
        .decode(shot["data"].as_str().unwrap())
        .unwrap();
    assert!(png.starts_with(b"\x89PNG"));
    let artifacts = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/test-artifacts");
    std::fs::create_dir_all(&artifacts).unwrap();
    std::fs::write(artifacts.join("console-pending-approval.png"), &png).unwrap();

    // Approve with a note, from the console. The note is typed (focused) and survives
    // the console's periodic refresh, which once rebuilt the queue and wiped it.
    let kept = page
        .eval(
            "(async () => { \
               const note = document.querySelector('#pending li[data-action=\"act-1\"] .note'); \
               note.focus(); note.value = 'checked in the console'; \
               await refresh(); await refresh(); \
               const after = document.querySelector('#pending li[data-action=\"act-1\"] .note'); \
               return after.value + '|' + (document.activeElement === after); })()",
        )
        .await;
    assert_eq!(kept, "checked in the console|true");
    page.eval(
        "document.querySelector('#pending li[data-action=\"act-1\"] .approve').click(); true",
    )
    .await;
    let start = Instant::now();
    loop {
        let action: Value = http
            .get(format!("{base}/v1/agents/mallory/actions/act-1"))
            .bearer_auth(ADMIN)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        if action["status"] == "allowed" {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "not approved: {action}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let log: Value = http
        .get(format!("{base}/v1/agents/mallory/log"))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let allowed = log["records"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["kind"] == "action_allowed")
        .expect("an action_allowed record");
    assert_eq!(allowed["payload"]["approved_by"], "console");
    assert_eq!(allowed["payload"]["note"], "checked in the console");
    page.wait_for("document.getElementById('pending').textContent.includes('Nothing is waiting')")
        .await;

    // Someone else decides first: the console says so (the 409), rather than failing
    // silently or claiming the approval.
    let decision: Value = http
        .post(format!("{base}/v1/agents/mallory/actions"))
        .bearer_auth(token)
        .json(&json!({"tool": "send", "input": {"body": "second"}}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let second = decision["action_id"].as_str().unwrap().to_string();
    page.wait_for(&format!(
        "document.querySelector('#pending li[data-action=\"{second}\"]') !== null"
    ))
    .await;
    let reply = http
        .post(format!("{base}/v1/agents/mallory/actions/{second}/reject"))
        .bearer_auth(ADMIN)
        .json(&json!({"approver": "bob", "reason": "not this one"}))
        .send()
        .await
        .unwrap();
    assert_eq!(reply.status(), 200);
    page.eval(&format!(
        "decide('mallory', '{second}', 'approve', {{approver: 'console', note: null}}); true"
    ))
    .await;
    let shown = page
        .wait_for("document.getElementById('error').textContent.includes('already decided') && document.getElementById('error').textContent")
        .await;
    assert!(shown.as_str().unwrap().contains("409"), "{shown}");
    page.wait_for("document.getElementById('queue-count').textContent === '0'")
        .await;
}
