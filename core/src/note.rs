//! One strict verifier for signed notes (c2sp.org/signed-note), used by every reader of
//! checkpoints here: the witness, the node, the checkpointer and the CLI.
//!
//! `signed_note`'s `Note::verify`, like Go's `x/mod/sumdb/note`, checks only the first
//! line of each known (name, key ID) and skips repeats, so a note could carry a good line
//! and then a bad one from the same key and still verify. Signed-note says a verifier
//! must verify every line of a key it knows, and tlog-witness says a witness answers 403
//! when such a line fails. Here every line whose name *and* key ID are known is verified;
//! a line matching only one of them is another key's, and ignored like any unknown key.

use signed_note::{Note, Signature, Verifier};

/// A note whose lines by known keys all verified.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifiedNote {
    /// The note's text, with its final newline.
    pub text: String,
    /// Each known key that signed, as (name, key ID), once, in the order first seen.
    pub signers: Vec<(String, u32)>,
    /// The signature lines that verified, each with its newline and its signer, in note
    /// order.
    pub lines: Vec<((String, u32), String)>,
}

impl VerifiedNote {
    pub fn signed_by(&self, verifier: &dyn Verifier) -> bool {
        self.signers
            .iter()
            .any(|(name, id)| name == verifier.name() && *id == verifier.key_id())
    }

    /// The text with only the verified lines: what a witness stores and serves.
    pub fn with_verified_lines(&self) -> String {
        let lines: String = self.lines.iter().map(|(_, line)| line.as_str()).collect();
        format!("{}\n{lines}", self.text)
    }

    /// The verified lines by `verifier`'s key.
    pub fn lines_by(&self, verifier: &dyn Verifier) -> String {
        self.lines
            .iter()
            .filter(|((name, id), _)| name == verifier.name() && *id == verifier.key_id())
            .map(|(_, line)| line.as_str())
            .collect()
    }
}

/// Why a note was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NoteError {
    #[error("malformed note: {0}")]
    Malformed(String),
    /// A line by a known key (name and key ID) whose signature does not verify.
    #[error("a signature line by {name}+{id:08x} does not verify")]
    BadSignature { name: String, id: u32 },
}

/// Verifies every line of `note` signed by one of `verifiers`. A note with no line by a
/// known key verifies, with no signers: callers say which signers they need.
pub fn verify_note(note: &str, verifiers: &[&dyn Verifier]) -> Result<VerifiedNote, NoteError> {
    // The crate checks the note's form (size, text, signature block) for us.
    Note::from_bytes(note.as_bytes()).map_err(|e| NoteError::Malformed(e.to_string()))?;
    let at = note
        .rfind("\n\n")
        .ok_or_else(|| NoteError::Malformed("no blank line before the signatures".into()))?;
    let (text, lines) = (&note[..=at], &note[at + 2..]);
    let mut verified = VerifiedNote {
        text: text.to_string(),
        signers: Vec::new(),
        lines: Vec::new(),
    };
    for line in lines.split_inclusive('\n') {
        let signature = Signature::from_bytes(line.trim_end_matches('\n').as_bytes())
            .map_err(|e| NoteError::Malformed(e.to_string()))?;
        let Some(verifier) = verifiers
            .iter()
            .find(|v| v.name() == signature.name() && v.key_id() == signature.id())
        else {
            continue;
        };
        if !verifier.verify(text.as_bytes(), signature.signature()) {
            return Err(NoteError::BadSignature {
                name: signature.name().to_string(),
                id: signature.id(),
            });
        }
        let signer = (signature.name().to_string(), signature.id());
        if !verified.signers.contains(&signer) {
            verified.signers.push(signer.clone());
        }
        verified.lines.push((signer, line.to_string()));
    }
    Ok(verified)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transparency::{Checkpoint, NoteSigner};
    use crate::AuditKey;

    fn signed(key: &AuditKey) -> (String, String) {
        let checkpoint = Checkpoint {
            origin: "example.com/log".into(),
            size: 3,
            root: [7; 32],
        };
        let note = checkpoint.sign(key).unwrap();
        let vkey = NoteSigner::new("example.com/log", key).unwrap().vkey();
        (note, vkey)
    }

    /// The note's signature line for `key` with one bit of its signature flipped.
    fn bad_copy(line: &str) -> String {
        let (head, b64) = line.trim_end().rsplit_once(' ').unwrap();
        use base64::Engine;
        let mut bytes = base64::engine::general_purpose::STANDARD
            .decode(b64)
            .unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        format!(
            "{head} {}\n",
            base64::engine::general_purpose::STANDARD.encode(bytes)
        )
    }

    #[test]
    fn a_bad_second_line_from_a_trusted_key_is_refused() {
        let key = AuditKey::from_seed([3; 32]);
        let (note, vkey) = signed(&key);
        let verifier = signed_note::StandardVerifier::new(&vkey).unwrap();
        let good = verify_note(&note, &[&verifier]).unwrap();
        assert!(good.signed_by(&verifier));
        assert_eq!(good.with_verified_lines(), note);

        let line = note.rsplit_once("\n\n").unwrap().1.to_string();
        let repeated = format!("{note}{}", bad_copy(&line));
        // signed_note alone accepts it: the reason this module exists.
        assert!(Note::from_bytes(repeated.as_bytes())
            .unwrap()
            .verify(&signed_note::VerifierList::new(vec![Box::new(
                signed_note::StandardVerifier::new(&vkey).unwrap()
            )]))
            .is_ok());
        assert!(matches!(
            verify_note(&repeated, &[&verifier]),
            Err(NoteError::BadSignature { .. })
        ));
        // And so does every reader built on it.
        assert!(Checkpoint::verify(&note, &vkey).is_ok());
        assert!(Checkpoint::verify(&repeated, &vkey).is_err());
        let origin_vkey = crate::heads::log_vkey("example.com/log", key.public_key_hex()).unwrap();
        assert!(crate::heads::verify_witnessed(&note, &origin_vkey, &[], 0).is_ok());
        assert!(crate::heads::verify_witnessed(&repeated, &origin_vkey, &[], 0).is_err());
        // Bad first, good second: refused too.
        let (text, _) = note.rsplit_once("\n\n").unwrap();
        let reordered = format!("{text}\n\n{}{line}", bad_copy(&line));
        assert!(verify_note(&reordered, &[&verifier]).is_err());
    }

    #[test]
    fn lines_of_other_keys_are_ignored_and_kept_out() {
        let key = AuditKey::from_seed([3; 32]);
        let (note, vkey) = signed(&key);
        let verifier = signed_note::StandardVerifier::new(&vkey).unwrap();
        let line = note.rsplit_once("\n\n").unwrap().1.to_string();
        // The same name with another key ID, and another name: neither is this key's.
        let (_, b64) = line.trim_end().rsplit_once(' ').unwrap();
        use base64::Engine;
        let mut bytes = base64::engine::general_purpose::STANDARD
            .decode(b64)
            .unwrap();
        bytes[0] ^= 0xff; // the key ID
        let other_id = format!(
            "— example.com/log {}\n",
            base64::engine::general_purpose::STANDARD.encode(&bytes)
        );
        let other_name = format!("— someone.else {b64}\n");
        let with_others = format!("{note}{other_id}{other_name}");
        let verified = verify_note(&with_others, &[&verifier]).unwrap();
        assert_eq!(verified.signers.len(), 1);
        assert_eq!(verified.with_verified_lines(), note);
        // With no trusted key, nothing signed it.
        assert!(verify_note(&note, &[]).unwrap().signers.is_empty());
        assert!(matches!(
            verify_note("not a note", &[&verifier]),
            Err(NoteError::Malformed(_))
        ));
    }
}
