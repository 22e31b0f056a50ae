//! `docs/openapi.yaml` describes exactly what a node serves: every documented operation
//! is a route, every route is documented, and a live node answers each listed method of
//! each route and refuses (405) every other. `GET /v1/openapi.json` serves the document,
//! without a token, from a follower as from the leader.

#[path = "cluster/util.rs"]
mod util;

use std::collections::BTreeSet;

use lineage_node::api::{openapi, route_table};
use reqwest::Method;
use serde_json::Value;
use util::Cluster;

const METHODS: [&str; 5] = ["get", "post", "put", "delete", "patch"];

fn documented() -> BTreeSet<(String, String)> {
    let doc = openapi::document().expect("docs/openapi.yaml parses");
    let paths = doc["paths"].as_object().expect("paths");
    let mut operations = BTreeSet::new();
    for (path, item) in paths {
        for method in METHODS {
            if item.get(method).is_some() {
                operations.insert((method.to_uppercase(), path.clone()));
            }
        }
    }
    operations
}

fn served() -> BTreeSet<(String, String)> {
    route_table()
        .into_iter()
        .map(|(method, path)| (method.to_string(), path.to_string()))
        .collect()
}

#[test]
fn every_route_is_documented_and_every_documented_operation_is_a_route() {
    let (documented, served) = (documented(), served());
    let undocumented: Vec<_> = served.difference(&documented).collect();
    let not_served: Vec<_> = documented.difference(&served).collect();
    assert!(
        undocumented.is_empty() && not_served.is_empty(),
        "served but not in docs/openapi.yaml: {undocumented:?}\n\
         in docs/openapi.yaml but not served: {not_served:?}"
    );
    // Each operation has an id, a summary, and at least one described response.
    let doc = openapi::document().expect("parses");
    for (method, path) in &documented {
        let operation = &doc["paths"][path][method.to_lowercase()];
        for field in ["operationId", "summary", "responses"] {
            assert!(
                !operation[field].is_null(),
                "{method} {path} has no {field}"
            );
        }
    }
}

/// A path template with its parameters filled in.
fn concrete(path: &str) -> String {
    path.replace("{id}", "probe-agent")
        .replace("{action_id}", "act-0")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_node_answers_exactly_the_listed_methods_and_serves_the_document() {
    let cluster = Cluster::start(3).await;
    let http = reqwest::Client::new();
    let served = served();
    let paths: BTreeSet<&String> = served.iter().map(|(_, path)| path).collect();
    for path in paths {
        let url = cluster.url(0, &concrete(path));
        for method in METHODS {
            let method = Method::from_bytes(method.to_uppercase().as_bytes()).expect("method");
            let listed = served.contains(&(method.to_string(), path.clone()));
            let reply = http
                .request(method.clone(), &url)
                .send()
                .await
                .expect("node answers");
            let status = reply.status().as_u16();
            let body: Value = reply.json().await.unwrap_or(Value::Null);
            if listed {
                assert_ne!(status, 405, "{method} {path} is listed but refused");
                assert_ne!(
                    body["code"], "unknown_route",
                    "{method} {path} is listed but not routed"
                );
            } else {
                assert_eq!(
                    (status, body["code"].as_str()),
                    (405, Some("method_not_allowed")),
                    "{method} {path} is not listed but answered"
                );
            }
        }
    }

    let expected = openapi::document().expect("parses");
    let leader = cluster
        .wait_for_leader(std::time::Duration::from_secs(15))
        .await;
    for node in 0..3 {
        let reply = http
            .get(cluster.url(node, "/v1/openapi.json"))
            .send()
            .await
            .expect("node answers");
        assert_eq!(reply.status(), 200, "node {node} (leader {leader})");
        assert_eq!(
            reply
                .headers()
                .get("content-type")
                .and_then(|v| v.to_str().ok()),
            Some("application/json")
        );
        let served: Value = reply.json().await.expect("JSON");
        assert_eq!(
            served, expected,
            "node {node} serves the document as written"
        );
    }
}
