package enivlan

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"aether.io/node/pkg/filelock"

	"github.com/containernetworking/cni/pkg/types"
)

// record says which pod holds the device of one (master, VLAN ID) pair.
// Linux allows one VLAN device per pair across all namespaces, so the next
// ADD for the same pair needs to know whether the holder is gone.
type record struct {
	Master       string `json:"master"`
	VLAN         int    `json:"vlan"`
	MAC          string `json:"mac"`
	ContainerID  string `json:"containerID"`
	NetNS        string `json:"netns"`
	IfName       string `json:"ifName"`
	PodNamespace string `json:"podNamespace"`
	PodName      string `json:"podName"`
	PodUID       string `json:"podUID,omitempty"`
}

func recordPath(dir, master string, vlan int) string {
	return filepath.Join(dir, master+"."+strconv.Itoa(vlan)+".json")
}

// lockState takes the state directory's lock (creating the directory).
func lockState(dir string) (func(), error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("failed to create state directory %q: %w", dir, err)
	}
	return filelock.Lock(filepath.Join(dir, "lock"), 0o600)
}

func readRecord(dir, master string, vlan int) (*record, error) {
	b, err := os.ReadFile(recordPath(dir, master, vlan))
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("failed to read ownership record: %w", err)
	}
	var r record
	if err := json.Unmarshal(b, &r); err != nil {
		// A torn record carries no owner: treat it as absent.
		return nil, nil
	}
	return &r, nil
}

// recordFilePath is the file an ADD prepares its record in before it
// knows the (master, VLAN ID) pair: one name per attachment (a runtime
// runs no two operations on one container at once), not a *.json name, so
// the scans of the state directory never read it, and a process that died
// before renaming it leaves at most one, which the attachment's DEL
// removes.
func recordFilePath(dir, containerID, ifName string) string {
	return filepath.Join(dir, containerID+"."+ifName+".tmp")
}

// createRecordFile creates the state directory and the attachment's record
// file (recordFilePath), truncated. Creating the file, the costly part of
// writing a record (a new inode), needs neither the state lock nor the
// pair, so ADD does it while it waits for spiderpool-agent.
func createRecordFile(dir, containerID, ifName string) (*os.File, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("failed to write ownership record: failed to create state directory %q: %w", dir, err)
	}
	p := recordFilePath(dir, containerID, ifName)
	f, err := os.OpenFile(p, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return nil, fmt.Errorf("failed to write ownership record: failed to create %q: %w", p, err)
	}
	return f, nil
}

// commitRecord writes r into f (from createRecordFile), closes it and
// renames it to r's record path, replacing any record there at once.
// Callers hold the state lock.
func commitRecord(f *os.File, dir string, r *record) error {
	p := recordPath(dir, r.Master, r.VLAN)
	b, err := json.Marshal(r)
	if err == nil {
		_, err = f.Write(b)
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(f.Name(), p)
	}
	if err != nil {
		return fmt.Errorf("failed to write ownership record %q: %w", p, err)
	}
	return nil
}

// discardRecordFile closes and removes a record file that was not
// committed.
func discardRecordFile(f *os.File) {
	_ = f.Close()
	_ = os.Remove(f.Name())
}

func removeRecord(dir, master string, vlan int) {
	_ = os.Remove(recordPath(dir, master, vlan))
}

// removeRecordsOf drops the records held by (containerID, ifName) (DEL).
func removeRecordsOf(dir, containerID, ifName string) {
	removeRecords(dir, func(r *record) bool { return r.ContainerID == containerID && r.IfName == ifName })
}

// dropRecordsExcept removes the records of attachments not in valid (GC:
// the runtime says those containers are gone).
func dropRecordsExcept(dir string, valid []types.GCAttachment) {
	keep := map[string]bool{}
	for _, v := range valid {
		keep[v.ContainerID+"/"+v.IfName] = true
	}
	removeRecords(dir, func(r *record) bool { return !keep[r.ContainerID+"/"+r.IfName] })
}

// removeRecords is the one scan of the state directory: it removes every
// record for which drop is true. Unreadable or torn records are left alone
// (they carry no owner; the next ADD of their pair treats them as absent).
// Callers hold the state lock.
func removeRecords(dir string, drop func(r *record) bool) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return
	}
	for _, e := range entries {
		if !strings.HasSuffix(e.Name(), ".json") {
			continue
		}
		p := filepath.Join(dir, e.Name())
		b, err := os.ReadFile(p)
		if err != nil {
			continue
		}
		var r record
		if json.Unmarshal(b, &r) == nil && drop(&r) {
			_ = os.Remove(p)
		}
	}
}
