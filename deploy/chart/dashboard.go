package chart

import (
	"encoding/json"
	"fmt"
	"strings"

	"sigs.k8s.io/yaml"
)

// DashboardFile is the chart's Grafana dashboard, relative to Dir.
const DashboardFile = "files/dashboards/aether-node.json"

// DashboardQueries returns the PromQL of every target of every panel of a
// Grafana dashboard (rows' nested panels included), in panel order. A
// target without a query is an error.
func DashboardQueries(raw []byte) ([]string, error) {
	type panel struct {
		Title   string  `json:"title"`
		Panels  []panel `json:"panels"`
		Targets []struct {
			Expr string `json:"expr"`
		} `json:"targets"`
	}
	var d struct {
		Panels []panel `json:"panels"`
	}
	if err := json.Unmarshal(raw, &d); err != nil {
		return nil, fmt.Errorf("failed to parse dashboard: %w", err)
	}
	var out []string
	var walk func([]panel) error
	walk = func(ps []panel) error {
		for _, p := range ps {
			for _, tg := range p.Targets {
				if strings.TrimSpace(tg.Expr) == "" {
					return fmt.Errorf("invalid dashboard: panel %q has a target without a query", p.Title)
				}
				out = append(out, tg.Expr)
			}
			if err := walk(p.Panels); err != nil {
				return err
			}
		}
		return nil
	}
	return out, walk(d.Panels)
}

// ResolveDashboardVars replaces the dashboard's Grafana variables in expr as
// Grafana does with every node selected and a rate window of window (a
// PromQL duration such as 1m).
func ResolveDashboardVars(expr, window string) string {
	return strings.NewReplacer("$__rate_interval", window, "$node", ".*").Replace(expr)
}

// PodSelection is what one kubernetes_sd_configs entry (role pod) of the
// chart's scrape configuration selects: the namespaces and the label
// selector.
type PodSelection struct {
	Namespaces []string
	// LabelSelector is a Kubernetes label selector (k=v,k2=v2).
	LabelSelector string
}

// ScrapeConfigsWithFileSD rewrites the chart's scrape-configs.yaml (a
// scrape_configs list) for a Prometheus built without Kubernetes service
// discovery, such as Debian's (its package removes it): each job's
// kubernetes_sd_configs becomes file_sd_configs reading file, every other
// key (the relabelling) unchanged. It returns the rewritten list and what
// each job's pod discovery selected, so the caller writes file in the
// shape kubernetes_sd would produce (one target per container port, with
// the same __meta_kubernetes_* labels).
func ScrapeConfigsWithFileSD(scrapeConfigs []byte, file string) ([]byte, []PodSelection, error) {
	var jobs []map[string]any
	if err := yaml.Unmarshal(scrapeConfigs, &jobs); err != nil {
		return nil, nil, fmt.Errorf("failed to parse scrape configs: %w", err)
	}
	var sel []PodSelection
	for _, job := range jobs {
		sds, ok := job["kubernetes_sd_configs"].([]any)
		if !ok {
			return nil, nil, fmt.Errorf("invalid scrape config %v: no kubernetes_sd_configs list", job["job_name"])
		}
		for _, sd := range sds {
			m, _ := sd.(map[string]any)
			if m["role"] != "pod" {
				return nil, nil, fmt.Errorf("invalid scrape config %v: kubernetes_sd_configs role %v, want pod", job["job_name"], m["role"])
			}
			var s PodSelection
			if ns, ok := m["namespaces"].(map[string]any); ok {
				for _, n := range ns["names"].([]any) {
					s.Namespaces = append(s.Namespaces, fmt.Sprint(n))
				}
			}
			if ss, ok := m["selectors"].([]any); ok {
				for _, x := range ss {
					if xm, _ := x.(map[string]any); xm["role"] == "pod" {
						s.LabelSelector, _ = xm["label"].(string)
					}
				}
			}
			sel = append(sel, s)
		}
		delete(job, "kubernetes_sd_configs")
		job["file_sd_configs"] = []any{map[string]any{"files": []any{file}, "refresh_interval": "1s"}}
	}
	out, err := yaml.Marshal(jobs)
	return out, sel, err
}
