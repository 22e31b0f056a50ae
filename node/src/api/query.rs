//! The one query-string parser of the API, and the extractor every handler that reads a
//! query takes: percent-decoded (`%31` is `1`, `+` is a space), each name at most once,
//! every bad value a 400 that names the parameter. Typed getters rather than a serde
//! `Query<T>`: serde_urlencoded's errors do not say which parameter was wrong.

use axum::extract::FromRequestParts;
use axum::http::request::Parts;

use super::error::ApiError;

pub struct Query {
    pairs: Vec<(String, String)>,
}

/// A query string longer than this is refused: no parameter of ours needs more.
const MAX_QUERY_BYTES: usize = 4096;

impl Query {
    pub fn parse(raw: Option<&str>) -> Result<Query, ApiError> {
        let raw = raw.unwrap_or("");
        if raw.len() > MAX_QUERY_BYTES {
            return Err(ApiError::BadRequest(format!(
                "query string is longer than {MAX_QUERY_BYTES} bytes"
            )));
        }
        let mut pairs: Vec<(String, String)> = Vec::new();
        for (name, value) in form_urlencoded::parse(raw.as_bytes()) {
            if pairs.iter().any(|(seen, _)| *seen == name) {
                return Err(ApiError::BadRequest(format!(
                    "query parameter {name} is given more than once"
                )));
            }
            pairs.push((name.into_owned(), value.into_owned()));
        }
        Ok(Query { pairs })
    }

    pub fn has(&self, name: &str) -> bool {
        self.pairs.iter().any(|(n, _)| n == name)
    }

    pub fn text(&self, name: &str) -> Option<&str> {
        self.pairs
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// A non-negative integer parameter, if present.
    pub fn number(&self, name: &str) -> Result<Option<u64>, ApiError> {
        self.text(name)
            .map(|value| {
                value.parse::<u64>().map_err(|_| {
                    ApiError::BadRequest(format!(
                        "{name} must be a non-negative integer, got {value:?}"
                    ))
                })
            })
            .transpose()
    }

    pub fn required_number(&self, name: &str) -> Result<u64, ApiError> {
        self.number(name)?
            .ok_or_else(|| ApiError::BadRequest(format!("{name} is required")))
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Query {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, ApiError> {
        Query::parse(parts.uri.query())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_percent_decoded_and_checked() {
        let q = Query::parse(Some("after=%31%32&limit=5&cursor=a%2Fb+c")).expect("parses");
        assert_eq!(q.number("after").expect("number"), Some(12));
        assert_eq!(q.number("limit").expect("number"), Some(5));
        assert_eq!(q.number("missing").expect("absent"), None);
        assert_eq!(q.text("cursor"), Some("a/b c"));
        assert!(q.has("limit") && !q.has("size"));
        let err = q.required_number("size").expect_err("required");
        assert_eq!(err.to_string(), "size is required");
        let bad = Query::parse(Some("after=-1")).expect("parses");
        assert_eq!(
            bad.number("after").expect_err("negative").to_string(),
            "after must be a non-negative integer, got \"-1\""
        );
        assert!(Query::parse(Some("after=1&after=2")).is_err());
        assert!(Query::parse(Some(&"a".repeat(MAX_QUERY_BYTES + 1))).is_err());
        assert!(Query::parse(None).expect("empty").text("x").is_none());
    }
}
