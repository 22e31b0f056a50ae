//! The HTTP side of the metrics: `GET /metrics` (refreshes the registry from this node,
//! then renders it) and the middleware that times every request inside its span.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use axum::extract::{MatchedPath, Request, State};
use axum::http::header::CONTENT_TYPE;
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::error::ApiError;
use crate::app::App;
use crate::metrics::NodeView;

/// How long a scrape waits for the applied state before it answers with the agents'
/// figures as they last were.
const STATE_WAIT: std::time::Duration = std::time::Duration::from_secs(1);

/// The applied state for the agents' figures, unless a write keeps it for longer than
/// `STATE_WAIT` (a commit on a stalled disk). Polled without holding it; once holders
/// are seen to come and go quickly (applies), the scrape queues with them.
async fn state_for_metrics(
    app: &App,
) -> Option<parking_lot::RwLockReadGuard<'_, crate::store::state_machine::SmData>> {
    let waited = Instant::now();
    loop {
        if let Some(state) = app.sm.try_read_data() {
            return Some(state);
        }
        let blocked = app.sm.state_blocked_for().unwrap_or_default();
        if blocked.max(waited.elapsed()) >= STATE_WAIT {
            return None;
        }
        if waited.elapsed() >= std::time::Duration::from_millis(20)
            && blocked < std::time::Duration::from_millis(20)
        {
            return Some(app.sm.read_data());
        }
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
}

/// `GET /metrics`.
pub async fn serve(State(app): State<Arc<App>>) -> Response {
    let state = state_for_metrics(&app).await;
    app.metrics.refresh_agents(state.as_deref());
    drop(state);
    app.metrics.refresh(&NodeView {
        id: app.id,
        sm: &app.sm,
        raft: &app.raft,
        committed_index: app.committed_index.load(Ordering::Relaxed),
        peers: &app.peers,
    });
    match app.metrics.render() {
        Ok(text) => ([(CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response(),
        Err(e) => ApiError::Internal(e).into_response(),
    }
}

/// Times every request by its route template (bounded cardinality), method and status,
/// inside a `request` span that carries the agent and action ids, the node and the term.
pub async fn track(State(app): State<Arc<App>>, request: Request, next: Next) -> Response {
    use tracing::Instrument;
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or("unmatched".to_string(), |p| p.as_str().to_string());
    let method = method_label(request.method());
    let (agent_id, action_id) = ids_in_path(request.uri().path());
    let term = app.raft.metrics().borrow().current_term;
    let span = tracing::info_span!(
        "request",
        method = %method,
        route = %route,
        agent_id = agent_id.unwrap_or(""),
        action_id = action_id.unwrap_or(""),
        node_id = app.id,
        term,
    );
    let start = Instant::now();
    let response = next.run(request).instrument(span.clone()).await;
    let elapsed = start.elapsed();
    let status = response.status();
    span.in_scope(|| {
        let elapsed_ms = elapsed.as_secs_f64() * 1e3;
        // A 503 says why where it is made (`ApiError`); one line per failure is enough.
        if status.is_server_error() && status != StatusCode::SERVICE_UNAVAILABLE {
            tracing::warn!(status = status.as_u16(), elapsed_ms, "request failed");
        } else {
            tracing::debug!(status = status.as_u16(), elapsed_ms, "request");
        }
    });
    app.metrics
        .http_request_duration
        .with_label_values(&[method, &route, status.as_str()])
        .observe(elapsed.as_secs_f64());
    response
}

/// A request's method as a metrics label: the standard ones by name, any other token
/// (hyper accepts any) as `other`, so that no client can add series without end.
fn method_label(method: &axum::http::Method) -> &'static str {
    use axum::http::Method;
    match *method {
        Method::GET => "GET",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::DELETE => "DELETE",
        Method::PATCH => "PATCH",
        Method::HEAD => "HEAD",
        Method::OPTIONS => "OPTIONS",
        _ => "other",
    }
}

/// The agent id and action id in a `/v1/agents/{id}/actions/{action_id}/…` path.
fn ids_in_path(path: &str) -> (Option<&str>, Option<&str>) {
    let mut parts = path.trim_start_matches('/').split('/');
    if parts.next() != Some("v1") || parts.next() != Some("agents") {
        return (None, None);
    }
    let agent = parts.next().filter(|s| !s.is_empty());
    let action = match (parts.next(), parts.next()) {
        (Some("actions"), Some(id)) if id != "pending" => Some(id),
        _ => None,
    };
    (agent, action)
}

#[cfg(test)]
mod tests {
    #[test]
    fn methods_outside_the_standard_ones_share_one_label() {
        use axum::http::Method;
        assert_eq!(super::method_label(&Method::POST), "POST");
        for name in ["A1", "A2", "PROPFIND", "CONNECT", "TRACE"] {
            let method = Method::from_bytes(name.as_bytes()).unwrap();
            assert_eq!(super::method_label(&method), "other", "{name}");
        }
    }

    #[test]
    fn ids_come_from_agent_paths_only() {
        use super::ids_in_path;
        assert_eq!(
            ids_in_path("/v1/agents/bot/actions/act-3/approve"),
            (Some("bot"), Some("act-3"))
        );
        assert_eq!(
            ids_in_path("/v1/agents/bot/actions/pending"),
            (Some("bot"), None)
        );
        assert_eq!(ids_in_path("/v1/agents/bot"), (Some("bot"), None));
        assert_eq!(ids_in_path("/v1/cluster"), (None, None));
    }
}
