package meshcontract

// SPIFFEID is the SPIFFE ID of a Kubernetes service account, as Istio and
// aether-node name workload identities:
// spiffe://<trustDomain>/ns/<namespace>/sa/<serviceAccount>. The agent's
// issuer, the listener metadata it sends the proxy and the proxy's peer
// index (from WDS) all build it here, so a peer's expected identity and the
// SVID it presents cannot drift apart. The inputs are not validated: the
// issuer (go-spiffe's spiffeid) checks them where an SVID is minted.
func SPIFFEID(trustDomain, namespace, serviceAccount string) string {
	return "spiffe://" + trustDomain + "/ns/" + namespace + "/sa/" + serviceAccount
}
