//! HTTP for the witness: `POST /add-checkpoint` (C2SP tlog-witness) and the monitoring
//! `GET /<hex SHA-256 of origin>/checkpoint`.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::header::CONTENT_TYPE;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;

use crate::witness::{Witness, MAX_REQUEST_BYTES};

pub fn router(witness: Arc<Witness>) -> Router {
    Router::new()
        .route("/add-checkpoint", post(add_checkpoint))
        .route("/{origin_hash}/checkpoint", get(monitoring))
        .layer(DefaultBodyLimit::max(MAX_REQUEST_BYTES))
        .with_state(witness)
}

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

async fn add_checkpoint(State(witness): State<Arc<Witness>>, body: Bytes) -> Response {
    let result = tokio::task::spawn_blocking(move || witness.add_checkpoint(&body, now_secs)).await;
    match result {
        Ok(Ok(reply)) => {
            let status =
                StatusCode::from_u16(reply.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            if status.is_client_error() {
                tracing::warn!(
                    status = reply.status,
                    reason = reply.body.trim(),
                    "add-checkpoint refused"
                );
            }
            (status, [(CONTENT_TYPE, reply.content_type)], reply.body).into_response()
        }
        Ok(Err(e)) => {
            tracing::error!(error = %e, "add-checkpoint failed");
            (StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n")).into_response()
        }
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n")).into_response(),
    }
}

async fn monitoring(
    State(witness): State<Arc<Witness>>,
    Path(origin_hash): Path<String>,
) -> Response {
    match witness.monitoring_checkpoint(&origin_hash.to_ascii_lowercase()) {
        Ok(Some(note)) => (
            StatusCode::OK,
            [(CONTENT_TYPE, "text/plain; charset=utf-8")],
            note,
        )
            .into_response(),
        Ok(None) => (
            StatusCode::NOT_FOUND,
            "no cosigned checkpoint for that origin\n",
        )
            .into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, format!("{e}\n")).into_response(),
    }
}
