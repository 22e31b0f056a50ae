//! `GET /v1/openapi.json`: the API reference, `docs/openapi.yaml`, compiled in and served
//! as JSON without auth. The YAML is written by hand (generators misdescribe our
//! hand-shaped JSON); `tests/openapi.rs` keeps it and the router in step.

use std::sync::OnceLock;

use axum::http::header::CONTENT_TYPE;
use axum::response::{IntoResponse, Response};

/// The document as written.
pub const DOCUMENT_YAML: &str = include_str!("../../../docs/openapi.yaml");

/// The document as a JSON value (an error names what in the YAML is wrong).
pub fn document() -> Result<serde_json::Value, String> {
    yaml_serde::from_str(DOCUMENT_YAML).map_err(|e| format!("docs/openapi.yaml: {e}"))
}

pub async fn serve() -> Response {
    static JSON: OnceLock<Result<String, String>> = OnceLock::new();
    let json = JSON.get_or_init(|| {
        document().and_then(|doc| serde_json::to_string(&doc).map_err(|e| e.to_string()))
    });
    match json {
        Ok(body) => ([(CONTENT_TYPE, "application/json")], body.clone()).into_response(),
        Err(e) => super::error::ApiError::Internal(e.clone()).into_response(),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_document_parses_as_openapi_3_1() {
        let doc = super::document().expect("docs/openapi.yaml parses");
        assert_eq!(doc["openapi"], "3.1.0");
        assert!(doc["paths"].as_object().is_some_and(|p| !p.is_empty()));
    }
}
