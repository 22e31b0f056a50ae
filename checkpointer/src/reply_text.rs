//! Reading an HTTP answer's body within a bound. The checkpointer talks to witnesses run
//! by other parties and to the nodes it monitors; neither may make it hold an answer of
//! any size in memory.

/// Most a witness answer may hold: a cosignature line, a size, or a monitoring note with
/// its cosignatures (a note parses only up to 100 lines).
pub const MAX_WITNESS_ANSWER_BYTES: usize = 64 * 1024;
/// Most a node answer may hold: a page of at most 1,000 heads-log leaves is well below
/// it, and every other answer the checkpointer reads (a note, a proof) is smaller.
pub const MAX_CLUSTER_ANSWER_BYTES: usize = 8 * 1024 * 1024;

/// The body of `reply` as text, read a chunk at a time, or an error naming the bound
/// once it holds more than `max` bytes (a stated length over it is refused unread).
pub async fn text_within(mut reply: reqwest::Response, max: usize) -> Result<String, String> {
    if reply.content_length().is_some_and(|n| n > max as u64) {
        return Err(format!("answer over {max} bytes"));
    }
    let mut body = Vec::new();
    while let Some(chunk) = reply.chunk().await.map_err(|e| e.to_string())? {
        if body.len() + chunk.len() > max {
            return Err(format!("answer over {max} bytes"));
        }
        body.extend_from_slice(&chunk);
    }
    String::from_utf8(body).map_err(|_| "answer is not UTF-8".to_string())
}
