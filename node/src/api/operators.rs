//! Operators over HTTP: `GET /v1/whoami`, and the registry (`/v1/operators`): list,
//! add, revoke, and the signed system log that records every change.

use std::sync::Arc;

use axum::extract::State;
use axum::http::{HeaderMap, Method};
use axum::routing::{get, post};
use axum::Json;
use lineage_core::operators::{Change, Operator, Role, BUILTIN_ADMIN};
use lineage_core::Record;
use serde::Deserialize;
use serde_json::{json, Value};

use super::auth::{principal, require, Need, Principal};
use super::body::JsonBody;
use super::error::ApiError;
use super::path::ApiPath;
use super::route_book::RouteBook;
use crate::app::App;

/// Largest page of the system log.
const LOG_PAGE_MAX: usize = 5000;

pub fn routes() -> RouteBook {
    RouteBook::default()
        .route("/v1/whoami", &[Method::GET], get(whoami))
        .route(
            "/v1/operators",
            &[Method::GET, Method::POST],
            get(list).post(add),
        )
        .route("/v1/operators/log", &[Method::GET], get(log))
        .route("/v1/operators/{name}/revoke", &[Method::POST], post(revoke))
}

/// Only the token's SHA-256 is accepted: a body that carries the token itself (any
/// field not listed) is refused, so it never reaches the log.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AddBody {
    name: String,
    role: String,
    token_sha256: String,
}

/// `GET /v1/whoami`: who the token speaks for (any valid token).
async fn whoami(State(app): State<Arc<App>>, headers: HeaderMap) -> Result<Json<Value>, ApiError> {
    Ok(Json(principal(&headers, &app)?.describe()))
}

fn view(operator: &Operator) -> Value {
    json!({
        "name": operator.name,
        "role": operator.role.as_str(),
        "active": operator.is_active(),
        "added_by": operator.added_by,
        "added_at": operator.added_at,
        "revoked_by": operator.revoked_by,
        "revoked_at": operator.revoked_at,
    })
}

/// The operator as this node's registry now holds it (a change is applied here once
/// `change_operators` returns).
fn operator_now(app: &App, name: &str) -> Result<Json<Value>, ApiError> {
    let data = app.sm.read_data();
    let operator = data
        .operators
        .get(name)
        .ok_or_else(|| ApiError::Internal(format!("operator {name} missing after its change")))?;
    Ok(Json(view(operator)))
}

/// The name a change is recorded under.
pub(super) fn changed_by(principal: &Principal) -> String {
    match principal {
        Principal::Operator { name, .. } => name.clone(),
        _ => BUILTIN_ADMIN.to_string(),
    }
}

/// `GET /v1/operators`: every operator ever added, revoked ones included.
async fn list(State(app): State<Arc<App>>, headers: HeaderMap) -> Result<Json<Value>, ApiError> {
    require(&headers, &app, Need::Read)?;
    let data = app.sm.read_data();
    let operators: Vec<Value> = data.operators.all().map(view).collect();
    Ok(Json(
        json!({"operators": operators, "head": data.operators.head()}),
    ))
}

/// `POST /v1/operators` `{name, role, token_sha256}` (admin).
async fn add(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    JsonBody(body): JsonBody<AddBody>,
) -> Result<Json<Value>, ApiError> {
    let principal = require(&headers, &app, Need::Admin)?;
    let role = Role::parse(&body.role).ok_or_else(|| {
        ApiError::BadRequest(format!(
            "role must be one of admin, approver, auditor, publisher; got {:?}",
            body.role
        ))
    })?;
    let name = body.name.clone();
    let change = Change::Add {
        name: body.name,
        role,
        token_sha256: body.token_sha256,
    };
    app.change_operators(change, &changed_by(&principal))
        .await?;
    operator_now(&app, &name)
}

/// `POST /v1/operators/{name}/revoke` (admin): the token stops working at once on the
/// leader, and on each follower once it applies the change.
async fn revoke(
    State(app): State<Arc<App>>,
    ApiPath(name): ApiPath<String>,
    headers: HeaderMap,
) -> Result<Json<Value>, ApiError> {
    let principal = require(&headers, &app, Need::Admin)?;
    let change = Change::Revoke { name: name.clone() };
    app.change_operators(change, &changed_by(&principal))
        .await?;
    operator_now(&app, &name)
}

/// `GET /v1/operators/log[?after=SEQ]`: the system log's signed records, as an agent's
/// log is served; `lineage audit verify` checks them like any log.
async fn log(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    query: super::query::Query,
) -> Result<Json<Value>, ApiError> {
    require(&headers, &app, Need::Read)?;
    let from = query.number("after")?.map_or(0, |a| a.saturating_add(1));
    let lines = app
        .sm
        .system_log_lines(from, LOG_PAGE_MAX)
        .map_err(ApiError::Internal)?;
    let records = lines
        .iter()
        .map(|line| Record::from_line(line).map_err(|e| ApiError::Internal(e.to_string())))
        .collect::<Result<Vec<_>, _>>()?;
    let head = app.sm.read_data().operators.head().cloned();
    Ok(Json(json!({"head": head, "records": records})))
}
