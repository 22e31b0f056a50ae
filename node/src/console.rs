//! The operator console at `/`: three static files compiled into the binary, served under
//! a strict Content Security Policy (no inline script, no external assets). The page
//! talks to the same API as every other client, with the admin token the operator enters.

use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE};
use axum::http::{HeaderValue, Method};
use axum::response::{IntoResponse, Response};
use axum::routing::get;

use crate::api::route_book::RouteBook;

const INDEX_HTML: &str = include_str!("console/index.html");
const CONSOLE_JS: &str = include_str!("console/console.js");
const CONSOLE_CSS: &str = include_str!("console/console.css");

/// Everything from this origin only; no inline script or style; no framing.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
     connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'";

pub fn routes() -> RouteBook {
    RouteBook::default()
        .route(
            "/",
            &[Method::GET],
            get(|| async { asset("text/html; charset=utf-8", INDEX_HTML) }),
        )
        .route(
            "/console.js",
            &[Method::GET],
            get(|| async { asset("text/javascript; charset=utf-8", CONSOLE_JS) }),
        )
        .route(
            "/console.css",
            &[Method::GET],
            get(|| async { asset("text/css; charset=utf-8", CONSOLE_CSS) }),
        )
}

fn asset(content_type: &'static str, body: &'static str) -> Response {
    let mut response = body.into_response();
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static(content_type));
    headers.insert(
        "content-security-policy",
        HeaderValue::from_static(CONTENT_SECURITY_POLICY),
    );
    headers.insert(
        "x-content-type-options",
        HeaderValue::from_static("nosniff"),
    );
    headers.insert("referrer-policy", HeaderValue::from_static("no-referrer"));
    headers.insert("x-frame-options", HeaderValue::from_static("DENY"));
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    response
}
