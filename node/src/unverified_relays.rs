//! Writes a follower relays although their token means nothing to its state: the token
//! may belong to an operator added a moment ago, not yet applied here, so only the
//! leader can judge it. Each such body is held whole while it is relayed, and anyone can
//! make up such a token, so these relays are rationed:
//! - at most [`SLOTS`] at once (8 MiB of bodies at most);
//! - at most one per client address, so one host that trickles bodies cannot keep every
//!   slot busy and turn away everyone else's (behind a proxy every client shares the
//!   proxy's address, and so one slot);
//! - each body must arrive whole within [`BODY_DEADLINE`] of its head, or is answered
//!   408, so a slot is never held longer than that by a slow sender.
//!
//! What a refusal costs is a 503 from this follower to an operator added a moment ago,
//! whose client then tries the next node.

use std::collections::HashSet;
use std::net::IpAddr;
use std::time::Duration;

use parking_lot::Mutex;

/// Relays of unknown tokens' writes at once.
pub const SLOTS: usize = 4;
/// How long such a write's body may take to arrive whole, from its head: 2 MiB at
/// 200 KB/s. (A body from a known token has the HTTP server's own, longer bound.)
pub const BODY_DEADLINE: Duration = Duration::from_secs(10);

/// The slots in use, by client address (`None`: a request that came with none, as from
/// an in-process router: those share one slot).
pub struct UnverifiedRelays {
    held: Mutex<HashSet<Option<IpAddr>>>,
    in_use: prometheus::IntGauge,
}

/// Why a relay was refused.
#[derive(Debug, PartialEq, Eq)]
pub enum Refused {
    /// This client address already has a relay of an unknown token in progress.
    AddressBusy,
    /// Every slot is in use.
    Full,
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Refused::AddressBusy => {
                "a write from this address with a token this node does not know is already \
                 being relayed; retry, or ask another node"
            }
            Refused::Full => {
                "too many writes with tokens this node does not know are being relayed; retry"
            }
        })
    }
}

/// A slot in use; freed when dropped.
pub struct Slot<'a> {
    relays: &'a UnverifiedRelays,
    from: Option<IpAddr>,
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        let mut held = self.relays.held.lock();
        held.remove(&self.from);
        self.relays.in_use.set(held.len() as i64);
    }
}

impl UnverifiedRelays {
    /// `in_use` is kept at the number of slots in use.
    pub fn new(in_use: prometheus::IntGauge) -> Self {
        UnverifiedRelays {
            held: Mutex::new(HashSet::new()),
            in_use,
        }
    }

    /// A slot for a relay from `from`, if one is free and `from` holds none.
    pub fn take(&self, from: Option<IpAddr>) -> Result<Slot<'_>, Refused> {
        // An IPv4 client on a dual-stack socket arrives as ::ffff:a.b.c.d: the same host.
        let from = from.map(|ip| ip.to_canonical());
        let mut held = self.held.lock();
        if held.contains(&from) {
            return Err(Refused::AddressBusy);
        }
        if held.len() >= SLOTS {
            return Err(Refused::Full);
        }
        held.insert(from);
        self.in_use.set(held.len() as i64);
        Ok(Slot { relays: self, from })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(text: &str) -> Option<IpAddr> {
        text.parse().ok()
    }

    fn relays() -> UnverifiedRelays {
        UnverifiedRelays::new(prometheus::IntGauge::new("in_use", "slots in use").unwrap())
    }

    #[test]
    fn one_slot_per_address_and_no_more_than_the_cap() {
        let relays = relays();
        let first = relays.take(ip("127.0.0.2")).unwrap();
        assert_eq!(
            relays.take(ip("127.0.0.2")).err(),
            Some(Refused::AddressBusy)
        );
        // The same host through a dual-stack socket.
        assert_eq!(
            relays.take(ip("::ffff:127.0.0.2")).err(),
            Some(Refused::AddressBusy)
        );
        let others: Vec<_> = ["127.0.0.3", "::1", "10.0.0.1"]
            .into_iter()
            .map(|from| relays.take(ip(from)).unwrap())
            .collect();
        assert_eq!(relays.in_use.get(), 4);
        assert_eq!(relays.take(ip("127.0.0.9")).err(), Some(Refused::Full));
        drop(first);
        assert_eq!(relays.in_use.get(), 3);
        let again = relays.take(ip("127.0.0.2")).unwrap();
        assert_eq!(relays.in_use.get(), 4);
        drop((again, others));
        assert_eq!(relays.in_use.get(), 0);
    }

    #[test]
    fn requests_without_an_address_share_one_slot() {
        let relays = relays();
        let first = relays.take(None).unwrap();
        assert_eq!(relays.take(None).err(), Some(Refused::AddressBusy));
        drop(first);
        assert!(relays.take(None).is_ok());
    }
}
